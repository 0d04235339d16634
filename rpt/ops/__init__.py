"""The recurrences, one folder each, laid out by op as flash-linear-attention lays out its ops: `lstm/`, `gru/`,
`modlstm/`, `minrnn/` (minGRU and minLSTM).

    spec.py          the step in plain torch (it imports torch alone): the readable reference that rpt's cells
                     (rpt/models/cells) run as their step and reference forms, and that `rpt export` ships beside
                     modeling_rpt.py, so the exported model runs the same file
    triton.py        the GPU forms (modlstm also triton_steps.py), on what rpt/kernels/triton/common.py shares
    scan.py          minrnn: the chunked scan in ATen ops (any device, no compiler)
    CELL_cpu.cpp     minrnn: the CPU form, built with rpt/kernels/cpu's loops (rpt/kernels/cpu/build.py)

gru's and modlstm's Python and C++ time loops are still in rpt/models/cells and rpt/kernels/cpu. The tests hold
every form equal to the spec, in float64.
"""
