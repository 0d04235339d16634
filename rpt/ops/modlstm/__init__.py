"""The modlstm recurrence: spec.py (the step and the built-in gates), triton.py and triton_steps.py (the GPU loops)."""
