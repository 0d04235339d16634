"""Data: corpus discovery, byte-level BPE, token shards, and the batch loader."""
