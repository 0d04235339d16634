"""The recurrences, one folder each, laid out by op as flash-linear-attention lays out its ops: `lstm/`, `gru/`,
`modlstm/`, `minrnn/` (minGRU and minLSTM), `mlstm/` (xLSTM's matrix-memory LSTM), `gdn/` (Gated DeltaNet), `loop/`
(the depth loop) and
`stack/` (the maths of the blocks and heads around the cells: attention, the gated MLP, the two-level head). Each
holds every file that defines its maths:

    spec.py          the step in plain torch (it imports torch alone): the readable reference that rpt's cells
                     (rpt/models/cells) run as their step and reference forms, and that `rpt export` ships beside
                     modeling_rpt.py, so the exported model runs the same file
    sequence.py      the recurrence over a sequence: `forms` (what can run it), `forward` (the one dispatch: it asks
                     the backend, rpt.kernels.current(), which form runs, once per call, and the backward runs the
                     same), and the fused kernel as torch custom operators (gru, modlstm)
    loops.py         gru, modlstm: the time loops as ATen ops from Python, the readable form of the C++ loops
    CELL_cpu.cpp     the C++ loops (and CELL_steps.h, each step's elementwise pass), built by rpt/kernels/cpu/build.py
    triton.py        the GPU forms (modlstm also triton_steps.py), on what rpt/kernels/triton/common.py shares
    scan.py          minrnn: the chunked scan in ATen ops (any device, no compiler)
    parallel.py      mlstm: the quadratic form over a whole window (as attention), the reference of the next
    chunkwise.py     mlstm, gdn: the training form, each chunk's summary carried between chunks (gdn: its
                     quadratic form is the one-chunk case)
    conv.py          gdn: the short causal convolution on q, k, v, its last inputs part of the state
    gates.py         modlstm: its gate functions by name (the built-in ones and those users register)

The cells in rpt/models/cells are thin modules over these: their parameters and options. The tests hold every form
equal to the spec, in float64.
"""
