"""A prepared dataset folder, opened for reading and checked against its own meta.json."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from rpt.data.shards import ShardedTokens
from rpt.errors import RptError

SPLITS = ("train", "val")


class PreparedData:
    """meta.json + tokenizer.json + one token file (or a folder of shards) per split, read back as memmaps."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if self.path.is_file():
            raise RptError(f"data.path = {self.path} is a file, not a prepared dataset",
                           f"prepare it first: `rpt prepare --input {self.path} --out data/{self.path.stem}`, then "
                           f"--set data.path=data/{self.path.stem}")
        if not meta_path.is_file():
            raise RptError(f"{self.path} is not a prepared dataset (no meta.json)",
                           f"point data.path at a folder `rpt prepare --out` wrote, or make one: "
                           f"`rpt prepare --out {self.path}` (the embedded corpus, Python's standard library: no "
                           f"--input) or `rpt prepare --input YOUR_TEXT --out {self.path}`")
        try:
            self.meta = json.loads(meta_path.read_text())
            self.vocab_size = int(self.meta["vocab_size"])
            self.eot_id = int(self.meta["eot_id"])
            self.dtype = np.dtype(self.meta["dtype"])
            missing = [split for split in SPLITS if split not in self.meta["splits"]]
            if missing:
                raise KeyError(f"no split {', '.join(missing)}")
        except (ValueError, KeyError, TypeError) as exc:
            raise RptError(f"{meta_path} is damaged ({exc})", "prepare the data again with --force") from None
        for split in SPLITS:
            for file, tokens in self._files(split):
                expected = tokens * self.dtype.itemsize
                if not file.is_file() or file.stat().st_size != expected:
                    raise RptError(f"{file} does not match meta.json (expected {expected} bytes): the dataset is "
                                   "incomplete", "prepare the data again with --force")

    def _files(self, split: str) -> list[tuple[Path, int]]:
        """(path, tokens) of a split's token files: one, or its shards in order."""
        info = self.meta["splits"][split]
        parts = info.get("shards") or [info]
        return [(self.path / part["file"], int(part["tokens"])) for part in parts]

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens: a memmap of its one file, or its shards as one array (opened as reads reach them)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        files = self._files(split)
        if "shards" in self.meta["splits"][split]:
            return ShardedTokens([f for f, _ in files], [n for _, n in files], self.dtype)
        (file, n), = files
        return np.memmap(file, dtype=self.dtype, mode="r", shape=(n,))

    def check_ids(self, split: str, vocab_size: int, sample: int = 4_000_000) -> None:
        """Refuse token ids the model has no embedding for: the whole split when it is small, else its first and
        last `sample` / 2 tokens (the training loop checks every batch it reads as well)."""
        tokens = self.tokens(split)
        half = sample // 2
        # slices: arrays, whether the split is one file or shards
        parts = [(0, tokens[:])] if len(tokens) <= sample else [(0, tokens[:half]), (len(tokens) - half, tokens[-half:])]
        for offset, part in parts:
            if len(part) and int(part.max()) >= vocab_size:
                position = offset + int(np.argmax(part >= vocab_size))
                raise_bad_id(int(tokens[position]), position, self.path / (self.meta["splits"][split].get("file") or split),
                             vocab_size)

    def num_bytes(self, split: str) -> int:
        """UTF-8 bytes of text behind a split's tokens: the denominator of bits per byte."""
        return int(self.meta["splits"][split]["bytes"])

    @cached_property
    def tokenizer(self):
        from rpt.data.tokenizer import load_tokenizer

        return load_tokenizer(self.path / "tokenizer.json")


def raise_bad_id(token: int, position: int | None, where, vocab_size: int) -> None:
    at = f" at token {position:,}" if position is not None else ""
    raise RptError(f"token id {token} in {where}{at} is outside the model's vocabulary of {vocab_size}",
                   "the token files do not belong to this tokenizer or are damaged: prepare the data again "
                   "(rpt prepare ... --force)")


def token_counts(tokens: np.ndarray, vocab_size: int, sample: int = 1 << 24, blocks: int = 256) -> np.ndarray:
    """Occurrences of each token id in `tokens`, or in `sample` of them read as `blocks` evenly spaced runs (a
    memory-mapped corpus is read in a few long runs, not one token from each of millions of pages)."""
    if len(tokens) > sample:
        blocks = min(blocks, sample)
        size = sample // blocks
        starts = np.linspace(0, len(tokens) - size, blocks).astype(np.int64)
        tokens = np.concatenate([tokens[s:s + size] for s in starts])
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
