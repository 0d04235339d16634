"""The minGRU / minLSTM recurrence: spec.py (the step), scan.py (the chunked scan), minrnn_cpu.cpp, triton.py."""
