"""The minGRU / minLSTM recurrence: spec.py (the step), sequence.py (forms, dispatch), scan.py, minrnn_cpu.cpp,
triton.py."""
