"""Sharded checkpoints through torch.distributed.checkpoint (DCP), atomic by a manifest written last.

    CHECKPOINTS/step_00001200/
        .metadata, __*.distcp      model + optimiser, saved by DCP (replicated tensors written once)
        extras/rank0.pt ...        what differs per rank: loader position, RNG states, recurrent state
        manifest.json              written by rank 0 after every rank finished: step, val loss, file checksums

A checkpoint is complete only when its manifest exists and every file matches its size and
checksum, so a crash in the middle of a save leaves the previous checkpoint the newest usable
one, and a damaged newest checkpoint is skipped with a warning naming it. Retention keeps the
last `keep_last` (the newest always, whatever keep_last says) and the best `keep_best`: the lowest validation loss among those measured on the
same validation tokens (`val_tokens` in the manifest), since losses over different token spans do not
compare. The folder may be a local or shared path, or an fsspec URL (`file://`, `s3://` with s3fs installed, ...).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
import warnings
from concurrent.futures import Future
from contextlib import contextmanager

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from rpt.errors import RptError

log = logging.getLogger("rpt.checkpoint")
# DCP warns that it "assumes a single process" whenever no process group exists: that is rpt's one-process mode.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MANIFEST = "manifest.json"
# Optimiser state as one entry per parameter and hyperparameter ("param_groups.blocks.3.cell.w_ih.lr"): ranks that
# hold different parameters (pipeline stages, parameter-server shards) then write different keys. The nested form
# has one "param_groups" list per rank under the same key, of which DCP keeps one: another stage's groups would
# come back on load.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
PREFIX = "step_"


class CheckpointStore:
    def __init__(self, root: str, rank: int = 0, world_size: int = 1, keep_last: int = 2, keep_best: int = 1,
                 async_save: bool = False, layout: dict | None = None):
        self.fs, self.root = fsspec.core.url_to_fs(str(root))
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.local = "file" in protocols
        self.rank, self.world_size = rank, world_size
        self.layout = {"world_size": world_size, **(layout or {})}  # how the ranks were arranged (manifest)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.async_save = async_save
        self._pending: tuple[Future, str, int, tuple[float, int] | None] | None = None
        self.damaged: dict[str, str] = {}  # path -> what is wrong, of checkpoints skipped when looking for one

    # ------------------------------------------------------------------ saving
    def save(self, step: int, model, optimizer, extras: dict, val: tuple[float, int] | None = None,
             before_commit=None) -> str:
        """Save (all ranks call this). With async_save the write goes on in the background. `val` is the
        (validation loss, tokens it covered) measured at this step, if any. `before_commit` runs between the
        shards and the manifest (fault injection: a crash in the middle of a save)."""
        self.finish_pending()
        path = f"{self.root}/{PREFIX}{step:08d}"
        if self.rank == 0:
            self.fs.makedirs(f"{path}/extras", exist_ok=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT) if optimizer is not None else (get_model_state_dict(model), None)
        with self.fs.open(f"{path}/extras/rank{self.rank}.pt", "wb") as f:
            buf = io.BytesIO()
            torch.save(extras, buf)
            f.write(buf.getvalue())
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            with _dcp_warnings_to_log():
                future = dcp.async_save(state, storage_writer=self._writer(path))
            self._pending = (future, path, step, val)
        else:
            with _dcp_warnings_to_log():
                dcp.save(state, storage_writer=self._writer(path))
            if before_commit is not None:
                before_commit()
            self._commit(path, step, val)
        return path

    def finish_pending(self) -> None:
        if self._pending is not None:
            future, path, step, val = self._pending
            self._pending = None
            future.result()
            self._commit(path, step, val)

    def _commit(self, path: str, step: int, val: tuple[float, int] | None) -> None:
        _barrier()  # every rank's files are written
        if self.rank == 0:
            files = {}
            for full in sorted(self.fs.find(path)):
                rel = full[len(path) + 1:]
                if not rel.startswith(MANIFEST):
                    files[rel] = {"bytes": self.fs.size(full), "sha256": self._sha256(full)}
            manifest = {"step": step, "val_loss": val[0] if val else None, "val_tokens": val[1] if val else None,
                        "world_size": self.world_size, "layout": self.layout, "time": time.time(), "files": files}
            self._write_manifest(path, manifest)
            self._retain()
        _barrier()

    def _write_manifest(self, path: str, manifest: dict) -> None:
        """Write beside, then move into place: a reader sees the old manifest or the new one, never half."""
        with self.fs.open(f"{path}/{MANIFEST}.tmp", "w") as f:
            f.write(json.dumps(manifest, indent=1))
        self.fs.mv(f"{path}/{MANIFEST}.tmp", f"{path}/{MANIFEST}")

    def set_val_loss(self, step: int, val: tuple[float, int]) -> None:
        """Attach a validation loss (and the tokens it covered) to a complete checkpoint's manifest, for keep_best."""
        if self.rank == 0:
            path = f"{self.root}/{PREFIX}{step:08d}/{MANIFEST}"
            with self.fs.open(path) as f:
                manifest = json.loads(f.read())
            manifest["val_loss"], manifest["val_tokens"] = val
            self._write_manifest(path.rsplit("/", 1)[0], manifest)
            self._retain()
        _barrier()

    def _writer(self, path: str):
        if self.local:
            return dcp.FileSystemWriter(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(self._url(path))

    def _reader(self, path: str):
        if self.local:
            return dcp.FileSystemReader(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(self._url(path))

    def _url(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{path}"

    def _sha256(self, path: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    def _retain(self) -> None:
        complete = self.complete()
        keep = {p for p, _ in complete[-max(1, self.keep_last):]}  # the newest always: what a resume continues
        keep |= {p for _, p in sorted(comparable(complete))[: self.keep_best]}
        newest = complete[-1][0] if complete else None
        for path in self._step_dirs():
            done = any(path == p for p, _ in complete)
            if (done and path not in keep) or (not done and newest is not None and path < newest):
                self.fs.rm(path, recursive=True)

    # ------------------------------------------------------------------ finding
    def _step_dirs(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(p.rstrip("/") for p in self.fs.ls(self.root, detail=False)
                      if p.rstrip("/").rsplit("/", 1)[-1].startswith(PREFIX))

    def complete(self, verify: bool = False) -> list[tuple[str, dict]]:
        """(path, manifest) of every checkpoint whose manifest exists, oldest first; `verify` checks the files."""
        out = []
        for path in self._step_dirs():
            try:
                with self.fs.open(f"{path}/{MANIFEST}") as f:
                    manifest = json.loads(f.read())
            except (FileNotFoundError, ValueError):
                continue
            if verify:
                problem = self._verify(path, manifest)
                if problem:
                    log.warning("skipping damaged checkpoint %s: %s", path, problem)
                    self.damaged[path] = problem
                    continue
            out.append((path, manifest))
        return out

    def _verify(self, path: str, manifest: dict) -> str | None:
        for rel, info in manifest.get("files", {}).items():
            full = f"{path}/{rel}"
            if not self.fs.exists(full):
                return f"{rel} is missing"
            if self.fs.size(full) != info["bytes"]:
                return f"{rel} has {self.fs.size(full)} bytes, the manifest says {info['bytes']}"
            if self._sha256(full) != info["sha256"]:
                return f"{rel} does not match its checksum"
        return None

    def latest(self) -> str | None:
        found = self.complete(verify=True)
        return found[-1][0] if found else None

    def best(self) -> str | None:
        found = comparable(self.complete(verify=True))
        return min(found)[1] if found else self.latest()

    def find(self, name: str, run_dir: str) -> str:
        """A checkpoint named as the CLI takes it (best, latest, step_N, N, or a folder) as a complete
        checkpoint's path; anything else is refused with the checkpoints there are."""
        found = {"best": self.best, "latest": self.latest}.get(name)
        if found is not None:
            path = found()
            if path is None:
                raise RptError(f"{run_dir} has no complete checkpoint yet", "wait for the first checkpoint, or train longer")
            return path
        candidates = [f"{self.root}/{name}", name]
        if name.removeprefix(PREFIX).isdigit():
            candidates.insert(0, f"{self.root}/{PREFIX}{int(name.removeprefix(PREFIX)):08d}")
        for candidate in candidates:
            path = self.fs._strip_protocol(candidate).rstrip("/")
            try:
                with self.fs.open(f"{path}/{MANIFEST}") as f:
                    manifest = json.loads(f.read())
            except (FileNotFoundError, NotADirectoryError, ValueError):
                continue
            problem = self._verify(path, manifest)
            if problem:
                raise RptError(f"the checkpoint {path} is damaged: {problem}",
                               "choose another one with --checkpoint (latest skips damaged checkpoints)")
            return path
        complete = self.complete()
        names = ", ".join(p.rsplit("/", 1)[-1] for p, _ in complete) or "none"
        raise RptError(f"no complete checkpoint '{name}' in {run_dir}",
                       f"--checkpoint takes best, latest, a step number or one of: {names}")

    def describe(self, path: str) -> str:
        """One line on a checkpoint: its step and the validation loss that ranks it."""
        with self.fs.open(f"{path}/{MANIFEST}") as f:
            m = json.loads(f.read())
        if m.get("val_loss") is None:
            return f"step {m['step']}, no validation loss recorded"
        tokens = f" on {m['val_tokens']:,} validation tokens" if m.get("val_tokens") else ""
        return f"step {m['step']}, ranked by val loss {m['val_loss']:.4f}{tokens}"

    # ------------------------------------------------------------------ loading
    def saved_layout(self, path: str) -> dict:
        """The layout a checkpoint was written with (older ones recorded the world size alone)."""
        with self.fs.open(f"{path}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        return manifest.get("layout") or {"world_size": manifest.get("world_size")}

    def resharded(self, path: str) -> bool:
        """Whether `path` was written with another layout than this run's (world size, pp, dp, fsdp)."""
        saved = self.saved_layout(path)
        return any(saved.get(k, v) != v for k, v in self.layout.items())

    def read_model(self, path: str) -> dict[str, torch.Tensor]:
        """The model's weights in the checkpoint at `path` as full CPU tensors, without building a model (DCP
        reassembles them from however many ranks wrote them): what train.init_from starts a new run from."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = self._reader(path).read_metadata().state_dict_metadata
        model = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
                 if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        dcp.load({"model": model}, storage_reader=self._reader(path))
        return model

    def load(self, path: str, model, optimizer=None, partial: bool = False) -> dict:
        """Load model (and optimiser) state into place, resharded by DCP to this run's layout; returns this
        rank's extras, or rank 0's when the checkpoint has another layout (its parts that hold for every rank:
        the step, the loader's global position, the budget). `partial`: the model is one pipeline stage, holding
        some of the checkpoint's keys."""
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
        else:
            model_sd, optim_sd = get_model_state_dict(model), None
        check_shapes(self._reader(path).read_metadata(), model_sd, path, partial)
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=self._reader(path))
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=FLAT)
        else:
            model.load_state_dict(state["model"])
        extras_path = f"{path}/extras/rank{0 if self.resharded(path) else self.rank}.pt"
        with self.fs.open(extras_path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=False)


def comparable(complete: list[tuple[str, dict]]) -> list[tuple[float, str]]:
    """(val loss, path) of the checkpoints whose loss was measured on the same validation tokens as the newest
    scored one: a loss over the first train.eval_tokens and one over the whole split do not rank together."""
    scored = [(m["val_loss"], m.get("val_tokens"), p) for p, m in complete if m.get("val_loss") is not None]
    if not scored:
        return []
    measure = scored[-1][1]
    return [(loss, p) for loss, tokens, p in scored if tokens == measure]


@contextmanager
def _dcp_warnings_to_log():
    """DCP's warnings (e.g. that it overwrites a damaged checkpoint's folder) go to the rank's log, not the terminal."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        log.info("torch.distributed.checkpoint: %s", w.message)


def check_shapes(metadata, model_sd: dict, path: str, partial: bool = False) -> None:
    """Refuse a checkpoint of another model shape, listing every key that differs."""
    saved = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    problems = []
    for key, tensor in model_sd.items():
        if key not in saved:
            problems.append(f"{key}: not in the checkpoint")
        elif hasattr(saved[key], "size") and tuple(saved[key].size) != tuple(tensor.shape):
            problems.append(f"{key}: checkpoint {tuple(saved[key].size)}, model {tuple(tensor.shape)}")
    if not partial:
        problems += [f"{key}: in the checkpoint, not in the model" for key in saved if key not in model_sd]
    if problems:
        listed = "\n    ".join(problems[:20]) + (f"\n    ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise RptError(f"the checkpoint {path} holds a model of another shape:\n    {listed}",
                       "resume with the model settings of that run (its config.toml), or start a new run directory")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
