"""The gru recurrence: spec.py (the step), sequence.py (forms, dispatch, the CPU kernel), loops.py, gru_cpu.cpp and
gru_steps.h, triton.py."""
