"""The recurrences, one folder each, laid out by op as flash-linear-attention lays out its ops: `lstm/`, `gru/`,
`modlstm/`, `minrnn/` (minGRU and minLSTM). Each folder's `spec.py` is the recurrence's step in plain torch (it
imports torch alone): the readable reference that rpt's cells (rpt/models/cells) run as their step and reference
forms, and that `rpt export` ships beside modeling_rpt.py, so the exported model runs the same file.

The fast paths (rpt/kernels: the C++ loops and the Triton kernels) are held equal to these specs by the tests.
"""
