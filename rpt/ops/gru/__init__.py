"""The gru recurrence: spec.py (its step in plain torch)."""
