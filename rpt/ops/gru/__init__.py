"""The gru recurrence: spec.py (the step), triton.py (the head-wise GPU loop)."""
