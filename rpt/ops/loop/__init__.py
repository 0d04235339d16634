"""Depth recurrence: spec.py (a core of blocks looped over a stack's state, in plain torch)."""
