"""The matrix-memory LSTM (xLSTM's mLSTM): spec.py (the step), parallel.py (the quadratic form), chunkwise.py
(the training form), sequence.py (which form runs)."""
