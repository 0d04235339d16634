"""A prepared dataset's splits written from its encoded units: deduplicated, split, cut into shards.

Every document of every unit, in unit order, is kept or dropped (`--dedup` keeps the first of the documents
whose texts hash alike), then goes to train or val: by a hash of its text when there are enough documents,
else the text's last share is val (the contiguous tail, for a corpus of a few large files). The kept tokens
are read once and written once, into SPLIT.bin or, above `shard_tokens`, SPLIT/00000.bin, ...; tokens,
UTF-8 bytes, documents and a sha256 of each file are counted on the way. Only the document tables are held
in memory (16 bytes a document), never the tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from rpt.data.sources import ReadReport
from rpt.data.units import unit_paths
from rpt.errors import RptError

MIN_EXPECTED_VAL_DOCS = 10  # below this many expected validation documents, the hash split is too lumpy
COPY_TOKENS = 1 << 24


def write_splits(folder: Path, results: list[dict], out: Path, dtype, lengths: np.ndarray, eot: int,
                 val_fraction: float, shard_tokens: int, dedup: bool, report: ReadReport, bar) -> tuple[dict, dict]:
    """(splits, split_rule) of meta.json, the splits written into `out`; `results` are the units' in order."""
    unit, starts, ends, hashes = _documents(folder, results)
    keep = np.ones(len(hashes), dtype=bool)
    if dedup:
        keep[:] = False
        keep[np.unique(hashes, return_index=True)[1]] = True
        report.duplicate_documents = int((~keep).sum())
        report.duplicate_tokens = int((ends - starts)[~keep].sum())
        report.documents -= report.duplicate_documents
    n_docs = int(keep.sum())
    is_val = hashes.astype(np.float64) / 2.0**64 < val_fraction
    if n_docs * val_fraction >= MIN_EXPECTED_VAL_DOCS and 0 < is_val[keep].sum() < n_docs:
        ranges = _runs(unit[keep], starts[keep], ends[keep], is_val[keep])
        rule = {"kind": "hash", "val_fraction": val_fraction,
                "rule": "document goes to val when blake2b-64(its UTF-8 text) / 2**64 < val_fraction"}
    else:
        kept = _runs(unit[keep], starts[keep], ends[keep], np.zeros(n_docs, dtype=bool))
        ranges = _cut_at(kept, _tail_boundary(folder, kept, dtype, lengths, 1.0 - val_fraction))
        rule = {"kind": "tail", "val_fraction": val_fraction,
                "rule": f"too few documents ({n_docs}) for a split by document; val is the text after the first "
                        f"{1 - val_fraction:g} of the bytes (from the next token boundary on)"}
    sizes = {side: sum(b - a for _, a, b, s in ranges if s == side) for side in (False, True)}
    for name, side in (("train", False), ("val", True)):
        if sizes[side] < 2:
            raise RptError(f"the {name} split would hold {sizes[side]} tokens: the corpus is too small",
                           "add more text, or change --val-fraction")
    bar.reset(total=sizes[False] + sizes[True])
    writers = {side: SplitWriter(out, name, sizes[side], shard_tokens, dtype, lengths, eot)
               for name, side in (("train", False), ("val", True))}
    for side, chunk in _read(folder, ranges, dtype):
        writers[side].write(chunk)
        bar.update(len(chunk))
    return {"train": writers[False].close(), "val": writers[True].close()}, rule


def _documents(folder: Path, results: list[dict]):
    """Every document's unit, start, end and hash, in order."""
    unit, starts, ends, hashes = [], [], [], []
    for r in results:
        with np.load(unit_paths(folder, r["unit"])["table"]) as table:
            s, h = table["starts"], table["hashes"]
        unit.append(np.full(len(s), r["unit"], dtype=np.int64))
        starts.append(s)
        ends.append(np.append(s[1:], r["tokens"]).astype(np.int64))
        hashes.append(h)
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dtype=dt)  # noqa: E731
    return cat(unit, np.int64), cat(starts, np.int64), cat(ends, np.int64), cat(hashes, np.uint64)


def _runs(unit, starts, ends, side) -> list[tuple[int, int, int, bool]]:
    """(unit, start, end, side) of runs of consecutive documents of one unit that go to the same side."""
    if not len(unit):
        return []
    joins = (unit[1:] == unit[:-1]) & (starts[1:] == ends[:-1]) & (side[1:] == side[:-1])
    first = np.concatenate([[0], np.flatnonzero(~joins) + 1])
    last = np.concatenate([first[1:], [len(unit)]]) - 1
    return [(int(unit[a]), int(starts[a]), int(ends[b]), bool(side[a])) for a, b in zip(first, last)]


def _read(folder: Path, ranges, dtype):
    """(side, tokens) chunks of the ranges, in order, by plain reads (a memmap's pages would count as the
    process's memory as it walks the files)."""
    itemsize = np.dtype(dtype).itemsize
    for u, a, b, side in ranges:
        with open(unit_paths(folder, u)["tokens"], "rb") as f:
            f.seek(a * itemsize)
            for c in range(a, b, COPY_TOKENS):
                yield side, np.fromfile(f, dtype=dtype, count=min(COPY_TOKENS, b - c))


def _tail_boundary(folder: Path, ranges, dtype, lengths: np.ndarray, fraction: float) -> int:
    """The first index of the kept tokens at which at least `fraction` of all their text bytes lie before it."""
    total_bytes = sum(int(lengths[chunk].sum(dtype=np.int64)) for _, chunk in _read(folder, ranges, dtype))
    target, seen, position = fraction * total_bytes, 0, 0
    for _, chunk in _read(folder, ranges, dtype):
        cum = seen + np.cumsum(lengths[chunk], dtype=np.int64)
        if len(cum) and cum[-1] >= target:
            return position + int(np.searchsorted(cum, target, side="left")) + 1
        seen, position = int(cum[-1]) if len(cum) else seen, position + len(chunk)
    return position


def _cut_at(ranges, boundary: int) -> list[tuple[int, int, int, bool]]:
    """The ranges with the tokens from `boundary` on (counted over all of them) sent to val."""
    out, position = [], 0
    for u, a, b, _ in ranges:
        cut = min(max(boundary - position, 0), b - a)
        if cut:
            out.append((u, a, a + cut, False))
        if a + cut < b:
            out.append((u, a + cut, b, True))
        position += b - a
    return out


class SplitWriter:
    """One split's tokens into NAME.bin, or NAME/00000.bin, ... of at most `shard_tokens` each when there are
    more; each file's tokens, bytes and sha256 counted as it is written."""

    def __init__(self, out: Path, name: str, total: int, shard_tokens: int, dtype, lengths: np.ndarray, eot: int):
        self.out, self.name, self.dtype, self.lengths, self.eot = out, name, np.dtype(dtype), lengths, eot
        self.limit = shard_tokens if total > shard_tokens else max(total, 1)
        self.sharded = total > shard_tokens
        if self.sharded:
            (out / name).mkdir()
        self.files: list[dict] = []
        self.f = None
        self.documents, self.first = 0, None

    def write(self, chunk: np.ndarray) -> None:
        if self.first is None and len(chunk):
            self.first = int(chunk[0])
        self.documents += int((chunk == self.eot).sum())
        while len(chunk):
            if self.f is None or self.files[-1]["tokens"] == self.limit:
                self._next_file()
            part, chunk = chunk[:self.limit - self.files[-1]["tokens"]], chunk[self.limit - self.files[-1]["tokens"]:]
            self.f.write(part.data)
            self.sha.update(part.data)
            self.files[-1]["tokens"] += len(part)
            self.files[-1]["bytes"] += int(self.lengths[part].sum(dtype=np.int64))

    def _next_file(self) -> None:
        self._close_file()
        name = f"{self.name}/{len(self.files):05d}.bin" if self.sharded else f"{self.name}.bin"
        self.f, self.sha = open(self.out / name, "wb"), hashlib.sha256()
        self.files.append({"file": name, "tokens": 0, "bytes": 0})

    def _close_file(self) -> None:
        if self.f is not None:
            self.f.close()
            self.files[-1]["sha256"] = self.sha.hexdigest()
            self.f = None

    def close(self) -> dict:
        self._close_file()
        tokens, n_bytes = sum(f["tokens"] for f in self.files), sum(f["bytes"] for f in self.files)
        documents = self.documents + (1 if self.first is not None and self.first != self.eot else 0)
        if self.sharded:
            return {"tokens": tokens, "bytes": n_bytes, "documents": documents, "shards": self.files}
        (whole,) = self.files
        return {"file": whole["file"], "tokens": tokens, "bytes": n_bytes, "documents": documents,
                "sha256": whole["sha256"]}
