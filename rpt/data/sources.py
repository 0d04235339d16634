"""Finding a corpus and reading it as a stream of documents.

Inputs are files, folders (walked recursively) and glob patterns; `.jsonl` files hold one
document per line in a text field; `.gz` and `.zst` of either are read through gzip and zstandard; `.parquet`
files hold one document per row in a text column, read a batch of rows at a time (pyarrow), never whole; so
does a Hugging Face `datasets` dataset saved with `save_to_disk` (a folder with state.json and its .arrow files),
read with pyarrow alone.
With no input the
embedded default is used: the source of the running Python's standard library, tests
excluded, which exists on every machine with Python.

Documents are files and jsonl records, split further where the text itself marks a boundary
with the end-of-document token. They are read as a stream of *pieces*: about 64K characters,
cut only where byte-level BPE would start a new pre-token anyway (after a newline that is
followed by a non-space character), so encoding the pieces gives exactly the tokens of the
whole document while the encoder gets many independent jobs to run in parallel and memory
stays bounded by the piece size, whatever the size of a file.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from rpt.data.text import replace_lone_surrogates
from rpt.errors import RptError

EOT = "<|endoftext|>"
PIECE_CHARS = 1 << 16
READ_BYTES = 1 << 20
MAX_CARRY_CHARS = 1 << 26  # a file with no safe cut in 64M characters is cut anyway
_SAFE_CUT = re.compile(r"\n(?=\S)")
_REPLACEMENT_UTF8 = "\ufffd".encode()
_DEFAULT_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Source:
    path: Path
    size: int  # bytes on disk (compressed size for .gz)

    @property
    def gzipped(self) -> bool:
        return self.path.name.lower().endswith(".gz")

    @property
    def zstd(self) -> bool:
        return self.path.name.lower().endswith(".zst")

    @property
    def is_jsonl(self) -> bool:
        name = self.path.name.lower().removesuffix(".gz").removesuffix(".zst")
        return name.endswith((".jsonl", ".ndjson"))

    @property
    def is_parquet(self) -> bool:
        return self.path.name.lower().endswith(".parquet")

    @property
    def is_arrow(self) -> bool:
        return self.path.name.lower().endswith(".arrow")


@dataclass
class ReadReport:
    """What reading the corpus met besides text; it ends up in meta.json and the prepare report."""

    documents: int = 0
    text_bytes: int = 0
    replaced_sequences: int = 0  # undecodable byte sequences replaced by U+FFFD
    skipped_binary: list[str] = field(default_factory=list)
    bad_jsonl_lines: int = 0  # lines that are not a JSON object
    missing_field_lines: int = 0  # JSON records without the text field (or with a non-string one)
    fields_seen: list[str] = field(default_factory=list)  # the fields of the first such record
    truncated_documents: int = 0  # documents longer than --max-doc-chars, cut there
    truncated_chars: int = 0  # the characters those cuts left out
    duplicate_documents: int = 0  # --dedup: documents dropped as exact copies of an earlier one
    duplicate_tokens: int = 0


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def discover(inputs: list[str] | None) -> list[Source]:
    """Expand inputs into a sorted, de-duplicated list of files; missing inputs are errors."""
    if not inputs:
        root = default_corpus_root()
        return [Source(p, p.stat().st_size) for p in _walk(root, suffix=".py", excluded=_DEFAULT_EXCLUDED_DIRS)]
    found: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir() and (saved := _saved_dataset(path)) is not None:
            found.extend(saved)
        elif path.is_dir():
            found.extend(_walk(path))
        elif path.is_file():
            found.append(path)
        elif glob.has_magic(item):
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(item), recursive=True))
            files = [m for m in matches if m.is_file()]
            for m in matches:
                if m.is_dir():
                    files.extend(_walk(m))
            if not files:
                raise RptError(f"the pattern '{item}' matches no file", "check the pattern; quote it so the shell does not expand it")
            found.extend(files)
        else:
            raise RptError(f"input '{item}' does not exist", "pass existing files, folders or glob patterns to --input")
    seen: set[Path] = set()
    sources = []
    for path in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            sources.append(Source(path, path.stat().st_size))
    return sources


def _saved_dataset(folder: Path) -> list[Path] | None:
    """The .arrow files of a dataset saved by Hugging Face `datasets` (`save_to_disk`), in its order; None for
    any other folder."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise RptError(f"{folder} holds a DatasetDict of the splits {', '.join(splits)}",
                       f"pass one split's folder, e.g. --input {folder / (splits[0] if splits else 'train')} "
                       "(rpt prepare makes its own validation split)")
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        files = [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise RptError(f"{state} is not the state file of a saved dataset", "save it again with save_to_disk") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RptError(f"the saved dataset {folder} lacks {', '.join(missing)}", "save it again with save_to_disk")
    return files


def _walk(root: Path, suffix: str | None = None, excluded: set[str] = frozenset()) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in excluded and d != "__pycache__")
        for name in sorted(filenames):
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            out.append(Path(dirpath) / name)
    return out


def iter_pieces(sources: list[Source], report: ReadReport, text_field: str = "text",
                max_doc_chars: int = 0, row_groups: tuple[int, int] | None = None) -> Iterator[tuple[str, bool]]:
    """Yield (piece, starts_document) over all documents of all sources, in order; a document longer than
    `max_doc_chars` (when set) is cut there, and the cut counted. `row_groups` = (first, end): only those row
    groups of a parquet file (the one source)."""
    new_doc = lambda: _DocumentCutter(report, max_doc_chars)  # noqa: E731
    for source in sources:
        if source.is_parquet or source.is_arrow:
            yield from _table_pieces(source, report, text_field, new_doc, row_groups)
            continue
        with _open_binary(source) as raw:
            try:
                head = raw.peek(8192)[:8192] if hasattr(raw, "peek") else b""
                if b"\x00" in head and not source.is_jsonl:
                    report.skipped_binary.append(str(source.path))
                    continue
                if source.is_jsonl:
                    yield from _jsonl_pieces(raw, report, text_field, new_doc)
                else:
                    yield from _text_pieces(raw, report, new_doc)
            except (OSError, EOFError) as exc:  # a damaged or cut-short .gz or .zst
                raise RptError(f"cannot read {source.path}: {exc}", "re-create or remove the damaged file") from None


def _open_binary(source: Source) -> BinaryIO:
    try:
        raw: BinaryIO = open(source.path, "rb")
        if source.gzipped:
            raw = io.BufferedReader(gzip.GzipFile(fileobj=raw))
        elif source.zstd:
            raw = io.BufferedReader(_ZstdReader(raw, source.path), READ_BYTES)
        return raw
    except OSError as exc:
        raise RptError(f"cannot read {source.path}: {exc.strerror}", "check the file's permissions") from None


class _ZstdReader(io.RawIOBase):
    """A .zst file as a stream of its decompressed bytes, frame after frame. Written here rather than zstandard's
    `stream_reader`, which ends a cut-off file quietly where its data stops; this one says it was cut."""

    def __init__(self, raw: BinaryIO, path: Path):
        import zstandard

        self.raw, self.path, self.zstandard = raw, path, zstandard
        self.frame, self.pending, self.partial = zstandard.ZstdDecompressor().decompressobj(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            block = self.raw.read(READ_BYTES)
            if not block:
                if self.partial:
                    raise EOFError(f"{self.path} ends in the middle of a zstd frame (the file was cut short)")
                return 0
            self.pending = self._decompress(block)
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def _decompress(self, block: bytes) -> bytes:
        out = []
        while block:
            try:
                out.append(self.frame.decompress(block))
            except self.zstandard.ZstdError as exc:
                raise EOFError(f"{self.path} is not valid zstd data ({exc})") from None
            self.partial = not self.frame.eof
            if self.partial:
                break
            block = self.frame.unused_data  # the next frame, if any
            self.frame = self.zstandard.ZstdDecompressor().decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _table_pieces(source: Source, report: ReadReport, text_field: str, new_doc,
                  row_groups: tuple[int, int] | None = None) -> Iterator[tuple[str, bool]]:
    """One document per row of the text column of a parquet file or of a saved dataset's .arrow file (Arrow's
    IPC stream, memory-mapped), a batch of rows at a time; a null or non-string value is counted as a record
    without the text field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = "parquet" if source.is_parquet else "an Arrow stream (a saved dataset's shard)"
    try:
        if source.is_parquet:
            file = pq.ParquetFile(source.path, pre_buffer=False)  # pre-buffered, 1 GB of parquet peaked at 0.79 GB
            columns = file.schema_arrow.names
            groups = list(range(*row_groups)) if row_groups else None
            batches = lambda: file.iter_batches(batch_size=1024, row_groups=groups, columns=[text_field],  # noqa: E731
                                                use_threads=False)
        else:
            reader = pa.ipc.open_stream(pa.memory_map(str(source.path)))
            columns = reader.schema.names
            batches = lambda: (b.select([text_field]) for b in reader)  # noqa: E731
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types for damaged files
        raise RptError(f"cannot read {source.path} as {kind}: {exc}", "re-create or remove the damaged file") from None
    if text_field not in columns:
        raise RptError(f"{source.path} has no column '{text_field}' (its columns: {', '.join(columns[:10])})",
                       f"choose the text column with --text-field, e.g. --text-field {columns[0] if columns else 'text'}")
    try:
        for batch in batches():
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    report.missing_field_lines += 1
                    report.fields_seen = report.fields_seen or columns[:10]
                    continue
                report.replaced_sequences += text.count("\ufffd")
                doc = new_doc()
                yield from doc.feed(text)
                yield from doc.finish()
    except (pa.ArrowException, OSError) as exc:  # a row group or batch that cannot be read
        raise RptError(f"cannot read {source.path} as {kind}: {exc}", "re-create or remove the damaged file") from None


def _text_pieces(raw: BinaryIO, report: ReadReport, new_doc) -> Iterator[tuple[str, bool]]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    doc = new_doc()
    while True:
        try:
            block = raw.read(READ_BYTES)
        except (OSError, EOFError) as exc:  # a corrupt .gz
            raise RptError(f"cannot read {getattr(raw, 'name', 'input')}: {exc}", "re-create or remove the damaged file") from None
        text = decoder.decode(block, final=not block)
        report.replaced_sequences += max(0, text.count("\ufffd") - block.count(_REPLACEMENT_UTF8))
        yield from doc.feed(text)
        if not block:
            break
    yield from doc.finish()


def _jsonl_pieces(raw: BinaryIO, report: ReadReport, text_field: str, new_doc) -> Iterator[tuple[str, bool]]:
    for line in io.TextIOWrapper(raw, encoding="utf-8", errors="replace"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            report.bad_jsonl_lines += 1
            continue
        text = record.get(text_field)
        if not isinstance(text, str):
            report.missing_field_lines += 1
            if not report.fields_seen:
                report.fields_seen = sorted(record)[:10]
            continue
        text, _ = replace_lone_surrogates(text)  # a "\\ud83d" escape without its pair: as an undecodable byte
        report.replaced_sequences += text.count("\ufffd")
        doc = new_doc()
        yield from doc.feed(text)
        yield from doc.finish()


class _DocumentCutter:
    """Turns a stream of text into pieces, starting a new document at each end-of-document marker."""

    def __init__(self, report: ReadReport, max_chars: int = 0):
        self.report, self.max_chars = report, max_chars
        self.carry = ""
        self.new_doc = True
        self.chars = 0  # of the current document, emitted

    def feed(self, text: str) -> Iterator[tuple[str, bool]]:
        buf = self.carry + text
        while (idx := buf.find(EOT)) >= 0:
            yield from self._emit(buf[:idx], final=True)
            buf = buf[idx + len(EOT):]
        self.carry = ""
        yield from self._emit(buf, final=False)

    def finish(self) -> Iterator[tuple[str, bool]]:
        buf, self.carry = self.carry, ""
        yield from self._emit(buf, final=True)

    def _emit(self, buf: str, final: bool) -> Iterator[tuple[str, bool]]:
        last = 0
        for match in _SAFE_CUT.finditer(buf):
            cut = match.end()
            if cut - last >= PIECE_CHARS:
                yield from self._piece(buf[last:cut])
                last = cut
        rest = buf[last:]
        if final or len(rest) > MAX_CARRY_CHARS:
            yield from self._piece(rest)
            rest = ""
        self.carry = rest
        if final:
            self.new_doc = True

    def _piece(self, piece: str) -> Iterator[tuple[str, bool]]:
        if self.new_doc:
            self.chars, self.cut = 0, False
        if self.max_chars and self.chars + len(piece) > self.max_chars:  # a piece starts at a safe cut: so
            keep = self.max_chars - self.chars                            # does the prefix's encoding
            self.report.truncated_documents += not self.cut
            self.report.truncated_chars += len(piece) - keep
            piece, self.cut = piece[:keep], True
        self.chars += len(piece)
        if not piece:
            return
        if self.new_doc:
            self.report.documents += 1
        self.report.text_bytes += len(piece.encode("utf-8"))
        yield piece, self.new_doc
        self.new_doc = False
