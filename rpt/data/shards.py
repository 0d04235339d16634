"""A split stored as several token files, read as one array.

`rpt prepare --shard-tokens N` writes a split of more than N tokens as train/00000.bin, train/00001.bin, ...
(at most N tokens each). `ShardedTokens` is what the loader and the evaluation index as they index one
memmap (`len`, integer-array and slice indexing, `dtype`), and it opens a shard only when a read first
touches it, so a rank reading its own streams maps only the files those streams cross. Written here rather
than with numpy or pyarrow: neither gives a lazily opened, memory-mapped concatenation of flat files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class ShardedTokens:
    def __init__(self, files: list[Path], counts: list[int], dtype):
        self.files, self.dtype = list(files), np.dtype(dtype)
        self.ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        self.starts = self.ends - np.asarray(counts, dtype=np.int64)
        self._open: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def shard(self, i: int) -> np.memmap:
        """Shard i, mapped on first use."""
        if i not in self._open:
            n = int(self.ends[i] - self.starts[i])
            self._open[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r", shape=(n,))
        return self._open[i]

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, stop)
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            s = int(np.searchsorted(self.ends, i, side="right"))
            return self.shard(s)[i - self.starts[s]]
        flat = np.asarray(index, dtype=np.int64)
        out = np.empty(flat.shape, dtype=self.dtype)
        which = np.searchsorted(self.ends, flat, side="right")
        for s in np.unique(which):  # each shard the read touches, once
            mask = which == s
            out[mask] = self.shard(int(s))[flat[mask] - self.starts[s]]
        return out

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        parts = [self.shard(s)[max(start, self.starts[s]) - self.starts[s]:min(stop, self.ends[s]) - self.starts[s]]
                 for s in range(first, last + 1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None):
        whole = self._range(0, len(self))
        return whole.astype(dtype) if dtype is not None else np.asarray(whole)
