"""Work units of `rpt prepare`: the corpus cut into pieces that workers encode one at a time, independently.

A unit is a run of consecutive whole files (small files grouped up to about UNIT_BYTES) or a run of row groups
of one large parquet file. The units are a function of the inputs alone (the sorted files, their sizes and the
parquet files' metadata), so every worker and every `--part` computes the same list, and what is written in
the end does not depend on how the units were spread over processes or machines.

Encoding a unit writes, into the work folder's units/, its tokens (every document as [EOT, tokens...], in
order) and its document table (where each document starts, and the blake2b-64 hash of its text that the split
and the deduplication use), then a small JSON file last: a unit with its JSON file is complete, so a prepare
that was stopped redoes only the units without one.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rpt.data.sources import ReadReport, Source, iter_pieces
from rpt.data.tokenizer import eot_id
from rpt.errors import RptError

UNIT_BYTES = 32 << 20  # on disk
ENCODE_BATCH_CHARS = 4 << 20


@dataclass(frozen=True)
class Unit:
    index: int
    files: tuple[int, ...]  # indices into the sources
    row_groups: tuple[int, int] | None  # (first, end) of the one parquet file's row groups; None: whole files
    size: int  # bytes on disk (a share of the file's size for row groups), for progress and the split into parts


def plan_units(sources: list[Source]) -> list[Unit]:
    unit_bytes = UNIT_BYTES
    units: list[Unit] = []
    group: list[int] = []

    def close() -> None:
        if group:
            units.append(Unit(len(units), tuple(group), None, sum(sources[i].size for i in group)))
            group.clear()

    for i, source in enumerate(sources):
        if source.is_parquet and source.size > unit_bytes:
            close()
            for first, end, size in _row_group_runs(source, unit_bytes):
                units.append(Unit(len(units), (i,), (first, end), size))
            continue
        group.append(i)
        if sum(sources[j].size for j in group) >= unit_bytes:
            close()
    close()
    return units


def _row_group_runs(source: Source, unit_bytes: int) -> list[tuple[int, int, int]]:
    """(first, end, bytes) of runs of row groups of about `unit_bytes` of the file each."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(source.path).metadata
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types for damaged files
        raise RptError(f"cannot read {source.path} as parquet: {exc}", "re-create or remove the damaged file") from None
    sizes = np.array([meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)], dtype=np.float64)
    on_disk = sizes / max(sizes.sum(), 1.0) * source.size  # row groups' share of the file
    runs, first, acc = [], 0, 0.0
    for g, size in enumerate(on_disk):
        acc += size
        if acc >= unit_bytes or g == len(on_disk) - 1:
            runs.append((first, g + 1, int(acc)))
            first, acc = g + 1, 0.0
    return runs


def assign_parts(units: list[Unit], parts: int) -> list[int]:
    """The part (0 .. parts-1) of each unit: contiguous runs of about equal bytes."""
    sizes = np.array([u.size for u in units], dtype=np.float64)
    middles = np.cumsum(sizes) - sizes / 2
    return [min(parts - 1, int(m / max(sizes.sum(), 1.0) * parts)) for m in middles]


@dataclass
class UnitJob:
    """What a worker needs to encode any unit; small and picklable."""

    sources: list[Source]
    tokenizer: str  # path of tokenizer.json
    dtype: str
    text_field: str
    max_doc_chars: int
    folder: str  # the work folder's units/


def unit_paths(folder: str | Path, index: int) -> dict[str, Path]:
    base = Path(folder) / f"{index:05d}"
    return {"tokens": base.with_suffix(".bin"), "table": base.with_suffix(".npz"), "done": base.with_suffix(".json")}


def read_done(folder: str | Path, index: int) -> dict | None:
    """A unit's result when it is complete, else None."""
    path = unit_paths(folder, index)["done"]
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def encode_unit(job: UnitJob, unit: Unit, tok, progress=None) -> dict:
    """Encode one unit into the work folder (module docstring); returns what its JSON file holds.

    Written under temporary names (with the process id) and renamed, the JSON file last."""
    paths = unit_paths(job.folder, unit.index)
    tmp = {k: p.with_name(f"{p.name}.tmp{os.getpid()}") for k, p in paths.items()}
    report = ReadReport()
    eot, dtype = eot_id(tok), np.dtype(job.dtype)
    doc_starts, doc_hashes = array("q"), array("Q")
    state = {"pos": 0, "hash": None, "bytes": 0}
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

    sources = [job.sources[i] for i in unit.files]
    # progress in bytes on disk, from the characters read: about one a character, a third compressed; the
    # unit's last share is counted when it is done
    per_char = 1.0 if not any(s.gzipped or s.zstd or s.is_parquet for s in sources) else 0.35
    shown = 0.0

    def advance(chars: int) -> None:
        nonlocal shown
        step = min(chars * per_char, 0.95 * unit.size - shown)
        if progress is not None and step > 0:
            progress(step)
            shown += step
    try:
        with open(tmp["tokens"], "wb") as f:
            chars = 0
            for piece, starts in iter_pieces(sources, report, job.text_field, job.max_doc_chars, unit.row_groups):
                batch.append((piece, starts))
                chars += len(piece)
                if chars >= ENCODE_BATCH_CHARS:
                    flush(f)
                    advance(chars)
                    chars = 0
            if batch:
                flush(f)
        finish_doc()
        with open(tmp["table"], "wb") as f:
            np.savez(f, starts=np.frombuffer(doc_starts, dtype=np.int64),
                     hashes=np.frombuffer(doc_hashes, dtype=np.uint64))
        os.replace(tmp["tokens"], paths["tokens"])
        os.replace(tmp["table"], paths["table"])
        done = {"unit": unit.index, "tokens": state["pos"], "documents": len(doc_starts), "report": asdict(report)}
        tmp["done"].write_text(json.dumps(done))
        os.replace(tmp["done"], paths["done"])
        if progress is not None:
            progress(unit.size - shown)
        return done
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)


def remove_unit(folder: str | Path, index: int) -> None:
    """A unit's files, complete or not (temporary ones of any process included)."""
    for p in unit_paths(folder, index).values():
        p.unlink(missing_ok=True)
        for leftover in p.parent.glob(p.name + ".tmp*"):
            leftover.unlink(missing_ok=True)
