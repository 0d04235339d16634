"""The minrnn recurrence: spec.py (its step in plain torch)."""
