"""The matrix-memory LSTM (xLSTM's mLSTM): spec.py (the step), parallel.py (the quadratic form), chunkwise.py
(the training form, which the cell runs on every device: its products on oneDNN on the CPU, cuBLAS on a GPU).

A fused GPU kernel: no maintained library fits yet, checked 2026-12-06. The xLSTM authors' `mlstm-kernels`
(2.0.6, installs here as a pure-Python wheel) is under the NXAI Community License, whose commercial terms bind
licensees above EUR 100M of revenue, and its chunkwise kernels take an initial state but no resets inside a
window (rpt resets the state at every end-of-document token); flash-linear-attention (MIT) has no mLSTM (its
request, fla-org/flash-linear-attention#109, is open). rpt's own Triton form, tested in the interpreter as the
other cells' are, is to come.
"""
