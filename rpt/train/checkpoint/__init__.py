"""Checkpoints: store.py writes, finds, verifies and loads them (DCP, atomic by a manifest); manager.py is the
trainer's component that decides when to save, what (one registry of everything with state) and which to select."""
