"""Monitoring: per-rank step metrics, the run's SQLite store, and the `rpt monitor` dashboard."""
