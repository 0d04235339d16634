"""The modlstm recurrence: spec.py (the step and the built-in gates), gates.py, sequence.py (forms, dispatch, the fused
kernel), loops.py, modlstm_cpu.cpp and modlstm_steps.h, triton.py and triton_steps.py (the GPU loops)."""
