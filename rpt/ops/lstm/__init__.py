"""The lstm recurrence: spec.py (the step), sequence.py (forms: torch's fused LSTM, or triton.py's head-wise GPU
loop)."""
