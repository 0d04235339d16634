"""Gradient synchronisation across data-parallel ranks: the modes (modes.py on gradient_sync.py), codecs (compress), accounting."""
