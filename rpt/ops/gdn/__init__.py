"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025): spec.py (the step and the layer around it), conv.py
(the short causal convolution on q, k, v, whose last inputs are part of the state), chunkwise.py (the training
form, and the quadratic form as its one-chunk case), library.py (flash-linear-attention's kernel on CUDA, rpt's
resets as its variable-length sequences), sequence.py (which of the two runs).
"""
