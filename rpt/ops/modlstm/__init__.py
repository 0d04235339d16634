"""The modlstm recurrence: spec.py (its step in plain torch)."""
