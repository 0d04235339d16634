"""`rpt prepare`: text in, token shards out.

    sources ─▶ pieces ─▶ (train BPE) ─▶ encode_batch (parallel, in Rust) ─▶ all.bin + document table
                                                                        ─▶ split ─▶ train.bin, val.bin, meta.json

Every document is written as [EOT, tokens...]: the end-of-document token opens each document,
so a model that resets its state at EOT starts every document fresh. The split is decided
once all documents are known, from a hash of each document's text: deterministic, and
duplicates always land on the same side. A corpus with too few documents for that (one big
file, like tiny-shakespeare) takes the contiguous tail of its tokens as validation instead.

Everything is written into a staging folder next to the output and moved in at the end,
meta.json last, so a failure leaves nothing half-done: a folder without meta.json is not a
dataset, and a complete older dataset stays complete until the new one replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zlib
from array import array
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

import rpt
from rpt.data.sources import EOT, ReadReport, Source, discover, iter_pieces
from rpt.data.tokenizer import (eot_id, file_sha256, load_tokenizer, token_byte_lengths,
                                train_tokenizer)
from rpt.errors import RptError

OUTPUT_FILES = ("tokenizer.json", "train.bin", "val.bin", "train", "val", "meta.json")  # meta.json last
SHARD_TOKENS = 100_000_000
ENCODE_BATCH_CHARS = 4 << 20
MIN_EXPECTED_VAL_DOCS = 10  # below this many expected validation documents, the hash split is too lumpy
COPY_TOKENS = 1 << 24


@dataclass
class PrepareOptions:
    out: Path
    inputs: list[str] | None = None
    vocab_size: int = 8192
    val_fraction: float = 0.1
    tokenizer: str | None = None
    text_field: str = "text"
    dtype: str = "auto"
    tokenizer_train_bytes: int = 1 << 30
    force: bool = False
    progress: bool = True
    shard_tokens: int = SHARD_TOKENS  # a split of more tokens is written as train/00000.bin, ... of at most this many
    dedup: bool = False  # drop documents whose text equals an earlier one's (by a 64-bit hash of it)
    max_doc_chars: int = 0  # cut documents longer than this many characters (0: no cap)


def prepare(opts: PrepareOptions) -> dict:
    """Prepare a dataset; returns its meta (with `reused: True` when the folder already held it)."""
    started = time.perf_counter()
    out = Path(opts.out)
    _check_options(opts)
    sources = discover(opts.inputs)
    if not sources:
        raise RptError("no input files were found", "pass files, folders or glob patterns that hold text")
    fingerprint = _fingerprint(opts, sources)
    existing = _check_output_folder(out, fingerprint, opts.force)
    if existing is not None:
        return {**existing, "reused": True}

    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        seconds = {}
        t = time.perf_counter()
        tok = _tokenizer(opts, sources)
        seconds["tokenizer"] = time.perf_counter() - t
        vocab = tok.get_vocab_size()
        dtype = _dtype(opts.dtype, vocab)
        tok.save(str(staging / "tokenizer.json"))

        t = time.perf_counter()
        report = ReadReport()
        doc_starts, doc_hashes, total = _encode(opts, sources, tok, dtype, staging / "all.bin", report)
        seconds["encode"] = time.perf_counter() - t
        if report.documents == 0:
            raise no_text_error(report, opts.text_field)
        if opts.dedup:
            doc_starts, doc_hashes, total = _dedup(staging / "all.bin", doc_starts, doc_hashes, total, dtype, report)

        t = time.perf_counter()
        lengths = token_byte_lengths(tok)
        split_rule = _split(staging, doc_starts, doc_hashes, total, dtype, opts.val_fraction, lengths)
        splits = {name: _split_stats(staging / f"{name}.bin", dtype, lengths, eot_id(tok)) for name in ("train", "val")}
        (staging / "all.bin").unlink()
        for name, stats in splits.items():
            if stats["tokens"] < 2:
                raise RptError(f"the {name} split would hold {stats['tokens']} tokens: the corpus is too small",
                               "add more text, or change --val-fraction")
            if stats["tokens"] > opts.shard_tokens:
                stats["shards"] = _cut_shards(staging, name, dtype, lengths, opts.shard_tokens)
                del stats["file"]
            else:
                stats["sha256"] = file_sha256(staging / stats["file"])
        seconds["split"] = time.perf_counter() - t
        seconds["total"] = time.perf_counter() - started

        meta = {
            "format": 1,
            "rpt_version": rpt.__version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "vocab_size": vocab,
            "dtype": np.dtype(dtype).name,
            "eot_token": EOT,
            "eot_id": eot_id(tok),
            "tokenizer_sha256": file_sha256(staging / "tokenizer.json"),
            "splits": splits,
            "split_rule": split_rule,
            "sources": {"inputs": opts.inputs or ["<python standard library>"], "files": len(sources),
                        "bytes": sum(s.size for s in sources)},
            "report": asdict(report),
            "fingerprint": fingerprint,
            "fingerprint_scheme": FINGERPRINT_SCHEME,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(staging, out)
        return meta
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_options(opts: PrepareOptions) -> None:
    if opts.max_doc_chars < 0:
        raise RptError(f"--max-doc-chars {opts.max_doc_chars} is negative", "use 0 for no cap, or e.g. 100000")
    if opts.shard_tokens < 2:
        raise RptError(f"--shard-tokens {opts.shard_tokens} is too small", f"use e.g. {SHARD_TOKENS:,} (the default)")
    if not 0.0 < opts.val_fraction < 1.0:
        raise RptError(f"--val-fraction {opts.val_fraction} is outside (0, 1)", "use e.g. 0.1 for 10% validation")
    if opts.dtype not in ("auto", "uint16", "uint32"):
        raise RptError(f"--dtype {opts.dtype} is not one of auto, uint16, uint32", "use --dtype auto")
    if opts.tokenizer is None and opts.dtype == "uint16" and opts.vocab_size > 1 << 16:
        raise RptError(f"a vocabulary of {opts.vocab_size} does not fit uint16 (at most {1 << 16} ids)",
                       "use --dtype uint32 (or auto), or --vocab-size 65536 or less")
    if opts.tokenizer_train_bytes <= 0:
        raise RptError("--tokenizer-train-bytes must be positive", "e.g. 1000000000 trains on about 1 GB")


# How _fingerprint reads the inputs; a folder written under another scheme cannot be compared with this one.
FINGERPRINT_SCHEME = 2  # 2: sources by content (1, unrecorded: by path and modification time)


def _fingerprint(opts: PrepareOptions, sources: list[Source]) -> str:
    h = hashlib.sha256()
    settings = {k: v for k, v in asdict(opts).items() if k not in ("out", "force", "progress", "inputs")}
    for key, default in (("shard_tokens", SHARD_TOKENS), ("dedup", False), ("max_doc_chars", 0)):
        if settings[key] == default:  # folders prepared before these options existed keep their fingerprint
            del settings[key]
    if opts.tokenizer:
        settings["tokenizer"] = file_sha256(opts.tokenizer) if Path(opts.tokenizer).is_file() else opts.tokenizer
    h.update(json.dumps(settings, sort_keys=True).encode())
    for s in sources:  # by content: a copied or re-checked-out corpus is the same dataset
        h.update(f"{s.path.name}\0{s.path.stat().st_size}\0{file_sha256(s.path)}\n".encode())
    return h.hexdigest()


def _check_output_folder(out: Path, fingerprint: str, force: bool) -> dict | None:
    """The existing meta when `out` already holds this very dataset; None when it may be written."""
    if out.exists() and not out.is_dir():
        raise RptError(f"--out {out} is a file", "choose a folder path for --out")
    meta_path = out / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError:
            meta = {}
        if meta.get("fingerprint") == fingerprint and not force:
            from rpt.data.dataset import PreparedData  # a complete dataset passes its own checks
            try:
                PreparedData(out)
                return meta
            except RptError:
                pass
        if not force and meta.get("fingerprint_scheme", 1) != FINGERPRINT_SCHEME:
            raise RptError(f"{out} was prepared by another version of rpt, whose fingerprint of the inputs cannot be "
                           "compared with this one's", "pass --force to prepare it again (or choose another --out)")
        if not force:
            raise RptError(f"{out} already holds a different dataset",
                           "choose another --out folder, or pass --force to replace it")
    elif not force and any((out / name).exists() for name in OUTPUT_FILES):
        raise RptError(f"{out} holds dataset files but no meta.json (an interrupted or foreign dataset)",
                       "choose another --out folder, or pass --force to replace them")
    return None


def _tokenizer(opts: PrepareOptions, sources: list[Source]):
    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
        _dtype(opts.dtype, tok.get_vocab_size())
        return tok
    total = sum(s.size for s in sources)
    keep = min(1.0, opts.tokenizer_train_bytes / max(total, 1))
    report = ReadReport()

    def sample():
        with _bar(opts, total, "train tokenizer") as bar:
            for piece, _ in iter_pieces(sources, report, opts.text_field, opts.max_doc_chars):
                bar.update(len(piece))
                if keep >= 1.0 or zlib.crc32(piece.encode("utf-8", "replace")) < keep * 2**32:
                    yield piece

    tok = train_tokenizer(sample(), opts.vocab_size)
    if report.documents == 0:
        raise no_text_error(report, opts.text_field)
    return tok


def no_text_error(report, text_field: str) -> RptError:
    """Why a corpus gave no document, from what reading it met."""
    if report.missing_field_lines:
        fields = ", ".join(report.fields_seen) or "none"
        return RptError(f"the corpus holds no text: {report.missing_field_lines:,} jsonl records have no string field "
                        f"'{text_field}' (the first one's fields: {fields})",
                        f"name the field that holds the text, e.g. --text-field {report.fields_seen[0]}"
                        if report.fields_seen else "name the field that holds the text with --text-field")
    if report.bad_jsonl_lines:
        return RptError(f"the corpus holds no text: {report.bad_jsonl_lines:,} lines of the .jsonl inputs are not "
                        "JSON objects", "write one JSON object per line, e.g. {\"text\": \"...\"}")
    return RptError("the corpus holds no text: every input is empty or was skipped as binary",
                    "pass text files, or .jsonl with the right --text-field")


def _dtype(requested: str, vocab: int):
    if requested == "uint16" and vocab > 1 << 16:
        raise RptError(f"the tokenizer's vocabulary of {vocab} does not fit uint16", "use --dtype uint32 or auto")
    if requested == "uint32" or vocab > 1 << 16:
        return np.uint32
    return np.uint16


def _encode(opts, sources, tok, dtype, path: Path, report: ReadReport):
    """Stream all documents through the encoder into one file; returns the document table."""
    eot = eot_id(tok)
    doc_starts, doc_hashes = array("q"), array("Q")
    state = {"pos": 0, "hash": None}
    batch: list[tuple[str, bool]] = []

    def finish_doc():
        if state["hash"] is not None:
            doc_hashes.append(int.from_bytes(state["hash"].digest(), "little"))

    def flush(f):
        encodings = tok.encode_batch_fast([p for p, _ in batch], add_special_tokens=False)
        ids: list[int] = []
        for (piece, starts), enc in zip(batch, encodings):
            if starts:
                finish_doc()
                state["hash"] = hashlib.blake2b(digest_size=8)
                doc_starts.append(state["pos"] + len(ids))
                ids.append(eot)
            state["hash"].update(piece.encode("utf-8"))
            ids.extend(enc.ids)
        np.asarray(ids, dtype=dtype).tofile(f)
        state["pos"] += len(ids)
        batch.clear()

    with open(path, "wb") as f, _bar(opts, sum(s.size for s in sources), "encode") as bar:
        chars = 0
        for piece, starts in iter_pieces(sources, report, opts.text_field, opts.max_doc_chars):
            batch.append((piece, starts))
            chars += len(piece)
            bar.update(len(piece))
            if chars >= ENCODE_BATCH_CHARS:
                flush(f)
                chars = 0
        if batch:
            flush(f)
    finish_doc()
    return np.frombuffer(doc_starts, dtype=np.int64), np.frombuffer(doc_hashes, dtype=np.uint64), state["pos"]


def _split(staging: Path, doc_starts, doc_hashes, total: int, dtype, val_fraction: float, lengths) -> dict:
    tokens = TokenFile(staging / "all.bin", dtype)
    is_val = doc_hashes.astype(np.float64) / 2.0**64 < val_fraction
    n_docs = len(doc_starts)
    if n_docs * val_fraction >= MIN_EXPECTED_VAL_DOCS and 0 < is_val.sum() < n_docs:
        ends = np.append(doc_starts[1:], total)
        with open(staging / "train.bin", "wb") as ftrain, open(staging / "val.bin", "wb") as fval:
            # Copy runs of consecutive documents that go to the same side in one write each.
            change = np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1
            run_starts = np.concatenate([[0], change])
            run_ends = np.concatenate([change, [n_docs]])
            for a, b in zip(run_starts, run_ends):
                _copy(tokens, doc_starts[a], ends[b - 1], fval if is_val[a] else ftrain)
        return {"kind": "hash", "val_fraction": val_fraction,
                "rule": "document goes to val when blake2b-64(its UTF-8 text) / 2**64 < val_fraction"}
    boundary = _byte_boundary(tokens, lengths, 1.0 - val_fraction)
    with open(staging / "train.bin", "wb") as ftrain, open(staging / "val.bin", "wb") as fval:
        _copy(tokens, 0, boundary, ftrain)
        _copy(tokens, boundary, total, fval)
    return {"kind": "tail", "val_fraction": val_fraction,
            "rule": f"too few documents ({n_docs}) for a split by document; val is the text after the first "
                    f"{1 - val_fraction:g} of the bytes (from the next token boundary on)"}


def _byte_boundary(tokens, lengths: np.ndarray, fraction: float) -> int:
    """The first token index at which at least `fraction` of all text bytes lie before it."""
    total_bytes = sum(int(lengths[np.asarray(tokens[a:a + COPY_TOKENS])].sum(dtype=np.int64))
                      for a in range(0, len(tokens), COPY_TOKENS))
    target, seen = fraction * total_bytes, 0
    for a in range(0, len(tokens), COPY_TOKENS):
        cum = seen + np.cumsum(lengths[np.asarray(tokens[a:a + COPY_TOKENS])], dtype=np.int64)
        if cum[-1] >= target:
            return a + int(np.searchsorted(cum, target, side="left")) + 1
        seen = int(cum[-1])
    return len(tokens)


def _copy(tokens, start: int, end: int, f) -> None:
    for a in range(int(start), int(end), COPY_TOKENS):
        np.asarray(tokens[a:min(a + COPY_TOKENS, int(end))]).tofile(f)


def _split_stats(path: Path, dtype, lengths: np.ndarray, eot: int) -> dict:
    n = path.stat().st_size // np.dtype(dtype).itemsize
    tokens = TokenFile(path, dtype)
    n_bytes = doc_starts = 0
    for a in range(0, n, COPY_TOKENS):
        chunk = np.asarray(tokens[a:a + COPY_TOKENS])
        n_bytes += int(lengths[chunk].sum(dtype=np.int64))
        doc_starts += int((chunk == eot).sum())
    documents = doc_starts + (1 if n and tokens[0] != eot else 0)
    return {"file": path.name, "tokens": n, "bytes": n_bytes, "documents": documents}


class TokenFile:
    """A token file read by ranges with plain reads, for the passes prepare makes over what it wrote: a memmap's
    pages count in the process's resident set as it walks the file (a 2 GB corpus peaked at 2.7 GB so)."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.n = path.stat().st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self[int(index):int(index) + 1][0]
        start, stop, _ = index.indices(self.n)
        with open(self.path, "rb") as f:
            f.seek(start * self.dtype.itemsize)
            return np.fromfile(f, dtype=self.dtype, count=max(0, stop - start))


def _dedup(path: Path, doc_starts, doc_hashes, total: int, dtype, report: ReadReport):
    """Keep the first of documents whose texts hash alike (blake2b-64 of the UTF-8 text, as the split uses):
    the token file is rewritten without the others, which the report counts."""
    _, first = np.unique(doc_hashes, return_index=True)
    keep = np.zeros(len(doc_hashes), dtype=bool)
    keep[first] = True
    if keep.all():
        return doc_starts, doc_hashes, total
    ends = np.append(doc_starts[1:], total)
    lengths = ends - doc_starts
    report.duplicate_documents = int((~keep).sum())
    report.duplicate_tokens = int(lengths[~keep].sum())
    report.documents -= report.duplicate_documents
    tokens = TokenFile(path, dtype)
    kept = path.with_name("dedup.bin")
    change = np.flatnonzero(np.diff(keep.astype(np.int8))) + 1  # runs of kept documents, one write each
    with open(kept, "wb") as f:
        for a, b in zip(np.concatenate([[0], change]), np.concatenate([change, [len(keep)]])):
            if keep[a]:
                _copy(tokens, doc_starts[a], ends[b - 1], f)
    del tokens
    os.replace(kept, path)
    new_lengths = lengths[keep]
    return np.concatenate([[0], np.cumsum(new_lengths)[:-1]]), doc_hashes[keep], int(new_lengths.sum())


def _cut_shards(staging: Path, split: str, dtype, lengths: np.ndarray, shard_tokens: int) -> list[dict]:
    """Cut staging/SPLIT.bin into SPLIT/00000.bin, ... of at most `shard_tokens` tokens; their counts and checksums."""
    path = staging / f"{split}.bin"
    n = path.stat().st_size // np.dtype(dtype).itemsize
    tokens = TokenFile(path, dtype)
    (staging / split).mkdir()
    shards = []
    for i, a in enumerate(range(0, n, shard_tokens)):
        b, name = min(n, a + shard_tokens), f"{split}/{i:05d}.bin"
        with open(staging / name, "wb") as f:
            _copy(tokens, a, b, f)
        n_bytes = sum(int(lengths[np.asarray(tokens[c:min(b, c + COPY_TOKENS)])].sum(dtype=np.int64))
                      for c in range(a, b, COPY_TOKENS))
        shards.append({"file": name, "tokens": b - a, "bytes": n_bytes, "sha256": file_sha256(staging / name)})
    del tokens
    path.unlink()
    return shards


def _move_into_place(staging: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # the old dataset stops being complete before any file changes
    for name in OUTPUT_FILES:  # a split written whole replaces the old one's shards, and shards a whole file
        src, dst = staging / name, out / name
        if dst.is_dir():
            shutil.rmtree(dst)
        elif not src.exists():
            dst.unlink(missing_ok=True)
        if src.exists():
            os.replace(src, dst)


def _bar(opts: PrepareOptions, total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not opts.progress or None,
                leave=False, dynamic_ncols=True)
