"""`rpt prepare`: text in, token shards out.

    sources ─▶ units ─▶ (train BPE) ─▶ workers: encode_batch ─▶ units/NNNNN.bin + document tables
                                                          ─▶ merge: dedup, split, shards ─▶ train/, val/, meta.json

Every document is written as [EOT, tokens...]: the end-of-document token opens each document,
so a model that resets its state at EOT starts every document fresh. The split is decided
once all documents are known, from a hash of each document's text: deterministic, and
duplicates always land on the same side. A corpus with too few documents for that (one big
file, like tiny-shakespeare) takes the contiguous tail of its tokens as validation instead.

The work happens in a folder beside the output (.NAME.work: the plan, the tokenizer, each unit's tokens) and
the dataset is moved in at the end, meta.json last, so a failure leaves nothing half-done: a folder without
meta.json is not a dataset, and a complete older dataset stays complete until the new one replaces it. The
units (rpt/data/units.py) are a function of the inputs alone, so `--workers N`, `--part i/n` on n machines
and a prepare resumed after an interruption (which keeps the units it finished) all write the same dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

import rpt
from rpt.data.merge import write_splits
from rpt.data.sources import EOT, ReadReport, Source, discover, iter_pieces
from rpt.data.tokenizer import (auto_vocab_size, eot_id, file_sha256, load_tokenizer, token_byte_lengths,
                                train_tokenizer)
from rpt.data.units import UnitJob, assign_parts, plan_units, read_done, remove_unit
from rpt.data.workers import run_units
from rpt.errors import RptError

OUTPUT_FILES = ("tokenizer.json", "train.bin", "val.bin", "train", "val", "meta.json")  # meta.json last
SHARD_TOKENS = 100_000_000


@dataclass
class PrepareOptions:
    out: Path
    inputs: list[str] | None = None
    vocab_size: int | str = "auto"  # or "auto": sized to the corpus's repeated words (auto_vocab_size)
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
    workers: int = 1  # processes encoding units on this machine
    part: tuple[int, int] | None = None  # (i, n): encode only part i of n (0 <= i < n); the last to finish merges
    merge: bool = False  # only write the dataset from the units the parts prepared (all must be complete)


HOW_NOT_WHAT = ("out", "force", "progress", "inputs", "workers", "part", "merge")  # options that leave the data as is


def prepare(opts: PrepareOptions) -> dict:
    """Prepare a dataset; returns its meta (with `reused: True` when the folder already held it), or for a part
    whose job is not complete yet, what is done (`part`, `units`, `units_done`)."""
    started = time.perf_counter()
    out = Path(opts.out)
    _check_options(opts)
    work = WorkFolder(out)
    if opts.merge:
        return _finish(work, started, {}, progress=opts.progress, explicit=True)
    sources = discover(opts.inputs)
    if not sources:
        raise RptError("no input files were found", "pass files, folders or glob patterns that hold text")
    fingerprint = _fingerprint(opts, sources)
    existing = _check_output_folder(out, fingerprint, opts.force)
    if existing is not None:
        return {**existing, "reused": True}
    units = plan_units(sources)
    work.start({"fingerprint": fingerprint, "units": len(units), "inputs": opts.inputs or ["<python standard library>"],
                "files": len(sources), "bytes": sum(s.size for s in sources),
                "options": {k: v for k, v in asdict(opts).items() if k not in HOW_NOT_WHAT}}, opts.force)
    mine = units if opts.part is None else [u for u, p in zip(units, assign_parts(units, opts.part[1]))
                                            if p == opts.part[0]]
    todo = [u for u in mine if read_done(work.units, u.index) is None]
    seconds = {}
    try:
        t = time.perf_counter()
        vocab = work.tokenizer(lambda: _tokenizer(opts, sources))
        seconds["tokenizer"] = time.perf_counter() - t
        dtype = _dtype(opts.dtype, vocab)
        for unit in todo:  # what a stopped run left of them
            remove_unit(work.units, unit.index)
        t = time.perf_counter()
        job = UnitJob(sources, str(work.path / "tokenizer.json"), np.dtype(dtype).name, opts.text_field,
                      opts.max_doc_chars, str(work.units))
        desc = "encode" if opts.part is None else f"encode part {opts.part[0]}/{opts.part[1]}"
        with _bar(opts, sum(u.size for u in mine), desc) as bar:
            bar.update(sum(u.size for u in mine) - sum(u.size for u in todo))  # done before a resume
            bar.set_postfix(workers=opts.workers, units=f"{len(mine) - len(todo)}/{len(mine)} done before")
            run_units(job, todo, opts.workers, bar)
        seconds["encode"] = time.perf_counter() - t
    except RptError:  # bad input: nothing of this run is kept
        for unit in todo:
            remove_unit(work.units, unit.index)
        work.remove_if_unused(opts.part is None)
        raise
    done = sum(read_done(work.units, u.index) is not None for u in units)
    if done < len(units):
        return {"part": list(opts.part), "units": len(units), "units_done": done, "units_mine": len(mine),
                "work": str(work.path), "reused": False}
    return _finish(work, started, seconds, progress=opts.progress, explicit=False)


class WorkFolder:
    """.NAME.work beside the output: plan.json (what is being prepared), tokenizer.json, units/, merge.lock."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.work"
        self.units = self.path / "units"

    def plan(self) -> dict | None:
        try:
            return json.loads((self.path / "plan.json").read_text())
        except (OSError, ValueError):
            return None

    def start(self, plan: dict, force: bool) -> None:
        """Begin, or continue the prepare of these very inputs and settings; another one's folder is refused
        (`force` discards it)."""
        old = self.plan()
        if self.path.exists() and (old is None or old["fingerprint"] != plan["fingerprint"]):
            if not force:
                raise RptError(f"{self.path} holds an unfinished prepare of other inputs or settings",
                               "finish it with the command that began it, or pass --force to discard it")
            shutil.rmtree(self.path)
        if old is not None and old["fingerprint"] == plan["fingerprint"]:
            return
        self.units.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path / "plan.json", json.dumps(plan, indent=2) + "\n")

    def tokenizer(self, make) -> int:
        """The job's tokenizer (made once, by `make`, and kept for parts and resumes); its vocabulary size.
        `make` returns the tokenizer and why its vocabulary has its size (None: as asked), kept for meta.json."""
        path = self.path / "tokenizer.json"
        if path.is_file():
            return load_tokenizer(path).get_vocab_size()
        tok, why = make()
        if why:
            _write_atomic(self.path / "vocab.txt", why)
        tmp = path.with_name(f"tokenizer.json.tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return tok.get_vocab_size()

    def remove_if_unused(self, whole_job: bool) -> None:
        """After a bad input: the folder goes when it is this run's alone or holds no finished unit."""
        if whole_job or not any(self.units.glob("*.json")):
            shutil.rmtree(self.path, ignore_errors=True)

    @contextmanager
    def merge_lock(self):
        """Held while one process writes the dataset; None when another live one holds it."""
        lock = self.path / "merge.lock"
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    holder = json.loads(lock.read_text())
                except (OSError, ValueError):
                    holder = {}
                if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                    lock.unlink(missing_ok=True)  # left by a process of this machine that is gone
                    continue
                yield holder or {"host": "?", "pid": "?"}
                return
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            try:
                yield None
            finally:
                lock.unlink(missing_ok=True)
            return


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _finish(work: WorkFolder, started: float, seconds: dict, progress: bool, explicit: bool) -> dict:
    """Write the dataset from the job's complete units (rpt/data/merge.py), then remove the work folder."""
    plan = work.plan()
    if plan is None and explicit and (work.out / "meta.json").is_file():  # merged already (by the last part)
        return {**json.loads((work.out / "meta.json").read_text()), "reused": True}
    if plan is None:
        raise RptError(f"there is no prepare of {work.out} to merge (no {work.path / 'plan.json'})",
                       "run the parts first: rpt prepare --input ... --out OUT --part i/n")
    results = [read_done(work.units, i) for i in range(plan["units"])]
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RptError(f"{len(missing)} of {plan['units']} units of {work.out} are not prepared yet "
                       f"(units {', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''})",
                       "run the parts that have not finished (the same command with their --part i/n); "
                       "the last one to finish writes the dataset")
    opts = plan["options"]
    with work.merge_lock() as holder:
        if holder is not None:
            if explicit:
                raise RptError(f"another process ({holder['host']}, pid {holder['pid']}) is writing {work.out}",
                               f"wait for it; if it is gone, remove {work.path / 'merge.lock'}")
            return {"part": None, "units": plan["units"], "units_done": plan["units"], "work": str(work.path),
                    "reused": False, "merging_elsewhere": holder}
        staging = work.path / "final"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            t = time.perf_counter()
            tok = load_tokenizer(work.path / "tokenizer.json")
            shutil.copyfile(work.path / "tokenizer.json", staging / "tokenizer.json")
            dtype = _dtype(opts["dtype"], tok.get_vocab_size())
            report = _sum_reports([r["report"] for r in results])
            if report.documents == 0:
                raise no_text_error(report, opts["text_field"])
            with tqdm(total=0, desc="write", unit="tok", unit_scale=True, disable=not progress or None, leave=False,
                      dynamic_ncols=True) as bar:
                splits, split_rule = write_splits(work.units, results, staging, dtype, token_byte_lengths(tok),
                                                  eot_id(tok), opts["val_fraction"], opts["shard_tokens"],
                                                  opts["dedup"], report, bar)
            seconds["split"] = time.perf_counter() - t
            seconds["total"] = time.perf_counter() - started
            meta = {
                "format": 1,
                "rpt_version": rpt.__version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "vocab_size": tok.get_vocab_size(),
                **({"vocab_choice": noted.read_text()} if (noted := work.path / "vocab.txt").is_file() else {}),
                "dtype": np.dtype(dtype).name,
                "eot_token": EOT,
                "eot_id": eot_id(tok),
                "tokenizer_sha256": file_sha256(staging / "tokenizer.json"),
                "splits": splits,
                "split_rule": split_rule,
                "sources": {"inputs": plan["inputs"], "files": plan["files"], "bytes": plan["bytes"]},
                "report": asdict(report),
                "units": plan["units"],
                "fingerprint": plan["fingerprint"],
                "fingerprint_scheme": FINGERPRINT_SCHEME,
                "seconds": {k: round(v, 3) for k, v in seconds.items()},
            }
            (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _move_into_place(staging, work.out)
        except RptError:  # the data itself is at fault (no text, too small): nothing is kept
            shutil.rmtree(work.path, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(work.path, ignore_errors=True)
    return meta


def _sum_reports(reports: list[dict]) -> ReadReport:
    total = ReadReport()
    for r in reports:
        for f in fields(ReadReport):
            if f.name == "skipped_binary":
                total.skipped_binary.extend(r[f.name])
            elif f.name == "fields_seen":
                total.fields_seen = total.fields_seen or r[f.name]
            else:
                setattr(total, f.name, getattr(total, f.name) + r[f.name])
    return total


def _check_options(opts: PrepareOptions) -> None:
    if opts.workers < 1:
        raise RptError(f"--workers {opts.workers} must be 1 or more", f"e.g. --workers {os.cpu_count() or 1}")
    if opts.part is not None and not 0 <= opts.part[0] < opts.part[1]:
        i, n = opts.part
        raise RptError(f"--part {i}/{n} is not a part of {n}", f"parts count from 0: --part 0/{n} ... --part {n - 1}/{n}"
                       if n > 0 else "e.g. --part 0/4 ... --part 3/4")
    if opts.max_doc_chars < 0:
        raise RptError(f"--max-doc-chars {opts.max_doc_chars} is negative", "use 0 for no cap, or e.g. 100000")
    if opts.shard_tokens < 2:
        raise RptError(f"--shard-tokens {opts.shard_tokens} is too small", f"use e.g. {SHARD_TOKENS:,} (the default)")
    if not 0.0 < opts.val_fraction < 1.0:
        raise RptError(f"--val-fraction {opts.val_fraction} is outside (0, 1)", "use e.g. 0.1 for 10% validation")
    if opts.dtype not in ("auto", "uint16", "uint32"):
        raise RptError(f"--dtype {opts.dtype} is not one of auto, uint16, uint32", "use --dtype auto")
    if not (opts.vocab_size == "auto" or isinstance(opts.vocab_size, int)):
        raise RptError(f"--vocab-size {opts.vocab_size} is neither a number nor auto", "use e.g. --vocab-size 8192, "
                       "or auto (sized to the corpus)")
    if opts.tokenizer is None and opts.dtype == "uint16" and opts.vocab_size != "auto" and opts.vocab_size > 1 << 16:
        raise RptError(f"a vocabulary of {opts.vocab_size} does not fit uint16 (at most {1 << 16} ids)",
                       "use --dtype uint32 (or auto), or --vocab-size 65536 or less")
    if opts.tokenizer_train_bytes <= 0:
        raise RptError("--tokenizer-train-bytes must be positive", "e.g. 1000000000 trains on about 1 GB")


# How _fingerprint reads the inputs; a folder written under another scheme cannot be compared with this one.
FINGERPRINT_SCHEME = 2  # 2: sources by content (1, unrecorded: by path and modification time)


def _fingerprint(opts: PrepareOptions, sources: list[Source]) -> str:
    h = hashlib.sha256()
    settings = {k: v for k, v in asdict(opts).items() if k not in HOW_NOT_WHAT}
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
    """The tokenizer (given, or trained on a sample of the corpus) and why its vocabulary has its size."""
    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
        _dtype(opts.dtype, tok.get_vocab_size())
        return tok, None
    total = sum(s.size for s in sources)
    keep = min(1.0, opts.tokenizer_train_bytes / max(total, 1))
    report = ReadReport()

    def sample(desc: str = "train tokenizer"):
        with _bar(opts, total, desc) as bar:
            for piece, _ in iter_pieces(sources, report, opts.text_field, opts.max_doc_chars):
                bar.update(len(piece))
                if keep >= 1.0 or zlib.crc32(piece.encode("utf-8", "replace")) < keep * 2**32:
                    yield piece

    vocab_size, why = opts.vocab_size, None
    if vocab_size == "auto":
        vocab_size, why = auto_vocab_size(sample("count words"))
        if report.documents == 0:
            raise no_text_error(report, opts.text_field)
        report = ReadReport()  # the tokenizer's pass reads the corpus again
    tok = train_tokenizer(sample(), vocab_size)
    if report.documents == 0:
        raise no_text_error(report, opts.text_field)
    return tok, why


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
