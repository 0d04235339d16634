"""Gradient synchronisation across data-parallel ranks: modes (sync), codecs (compress), accounting."""
