"""The lstm recurrence: spec.py (its step in plain torch)."""
