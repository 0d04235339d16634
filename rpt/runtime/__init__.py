"""What a training or serving process sets up for itself, apart from the model: memory.py (the CPU allocator's
settings: keep_freed_memory, pool_large_blocks, return_large_blocks), page_pool.cpp (the page pool those use, built
with the native loops by rpt/kernels/cpu/build.py), signals.py (Ctrl-C and SIGTERM as a request to stop at a step),
version.py (the commit a result came from)."""
