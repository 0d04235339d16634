"""The checkpoint section as a component of the trainer: when to save, and what.

The store (rpt/train/checkpoint/store.py: where checkpoints are written, found, verified and loaded) is this
component's own: the trainer asks it to save, resume and select, never the store. A checkpoint holds the model,
the optimiser, and every part of the run that has state, as one registry
(name -> object with `state_dict()` / `load_state_dict()`): saving writes each part's state under its name,
resuming hands each part its own back, so what is saved and what is restored cannot drift apart.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
from tqdm import tqdm

from rpt.errors import RptError
from rpt.train.checkpoint.store import CheckpointStore
from rpt.train.hooks import StepHooks

log = logging.getLogger("rpt.train")


class Checkpointing:
    def __init__(self, cfg, default_root: str, rank: int, world_size: int, is_main: bool, hooks: list[StepHooks],
                 state, layout: dict | None = None):
        """`cfg`: the checkpoint section; `state`: what a checkpoint holds (rpt.parallel.runner.CheckpointState: the
        model, its optimiser and every part with state), the one provider save and resume read and write;
        `layout`: the run's shape (pp, dp, fsdp, cp), which a checkpoint records and a resume compares."""
        self.cfg, self.is_main, self.hooks, self.state = cfg, is_main, hooks, state
        self._store = CheckpointStore(cfg.path or default_root, rank, world_size, cfg.keep_last, cfg.keep_best,
                                      cfg.async_save, layout)
        self.last_saved_step = -1
        self.saved_at: float | None = None  # the agreed training clock at the last timed checkpoint (or the start)

    def describe(self) -> str:
        """How often this run checkpoints, as its start states it."""
        every = [f"{self.cfg.interval:,} steps (checkpoint.interval)"] if self.cfg.interval else []
        every += [f"{self.cfg.interval_minutes:g} min of training (checkpoint.interval_minutes)"] \
            if self.cfg.interval_minutes else []
        return "checkpoints: " + (f"every {' and every '.join(every)}, and at the end" if every else
                                  "at the end only (checkpoint.interval and interval_minutes are 0)")

    def should_save(self, step: int, clock: float | None) -> bool:
        """Whether to checkpoint after `step`. `clock`: the training seconds every rank agreed on at this step,
        None where they did not agree one (the timed decision waits for an agreed clock, so that the ranks
        decide alike)."""
        due = bool(self.cfg.interval) and step % self.cfg.interval == 0
        if self.cfg.interval_minutes and clock is not None:
            if self.saved_at is None:
                self.saved_at = clock
            due = due or clock - self.saved_at >= 60 * self.cfg.interval_minutes
        if due and clock is not None:
            self.saved_at = clock
        return due

    def _written(self, step: int) -> None:
        for hook in self.hooks:
            hook.checkpoint_written(step)

    def save(self, step: int, val: tuple[float, int] | None) -> None:
        """A checkpoint of `step`, ranked by `val` (loss, validation tokens) when it has one."""
        st = self.state
        extras = {name: part.state_dict() for name, part in st.parts.items()}
        path = self._store.save(step, st.model, st.optimizer, extras, val=val,
                                before_commit=lambda: self._written(step))
        for hook in self.hooks:
            hook.checkpoint_complete(step, None if self.cfg.async_save else path)
        self.last_saved_step = step

    def finish(self, step: int, val: tuple[float, int]) -> None:
        """The end of a run: its last step saved (or, saved by the interval at this very step, given its loss)."""
        if self.last_saved_step == step:
            self._store.finish_pending()
            self._store.set_val_loss(step, val)
        else:
            self.save(step, val)
        self._store.finish_pending()

    def resume(self) -> str | None:
        """Load the newest complete checkpoint into the model, the optimiser and every part; its path, or None
        (a run with no complete checkpoint starts from step 0, and says so). A checkpoint of another layout
        loads resharded, and the parts that are one rank's own (the state's `per_rank`: random generators,
        codec state) start afresh, as they would in a new run."""
        st = self.state
        parts, per_rank = st.parts, st.per_rank
        path = self._store.latest()
        for damaged, problem in self._store.damaged.items():
            self._say(f"skipping the damaged checkpoint {damaged}: {problem}")
        if path is None:
            log.info("no complete checkpoint to resume from; starting fresh")
            self._say(f"no complete checkpoint in {self._store.root}: this run starts fresh from step 0")
            return None
        resharded = self._store.resharded(path)
        extras = self._store.load(path, st.model, st.optimizer, partial=st.partial)
        if resharded:
            parts = {name: part for name, part in parts.items() if name not in per_rank}
            saved = ", ".join(f"{k} {v}" for k, v in self._store.saved_layout(path).items())
            now = ", ".join(f"{k} {v}" for k, v in self._store.layout.items())
            self._say(f"resuming {path} (written with {saved}) on {now}: model and optimiser resharded, the data "
                      f"continues from its global position; the recurrent state and {', '.join(per_rank)} start "
                      "afresh")
        missing = [name for name in parts if name not in extras]
        if missing:
            raise RptError(f"{path} holds no state for {', '.join(missing)}: it was written by an older rpt",
                           "resume it with the rpt that wrote it, or start a new run from its weights")
        for name, part in parts.items():
            part.load_state_dict(extras[name])
        log.info("resumed from %s", path)
        return path

    def latest(self) -> str | None:
        """The newest complete checkpoint's path."""
        return self._store.latest()

    def finish_pending(self) -> None:
        """Wait for an asynchronous save still being written."""
        self._store.finish_pending()

    def select_best(self, step: int, best: dict, best_weights: dict | None) -> dict:
        """Put the weights of the best periodic validation `best` (its step, loss, tokens) into `model`: from
        `best_weights` where this run kept them (written as a weights-only checkpoint of their step unless one is
        there), else from that step's checkpoint (a resumed run); the selection as the summary records it. The
        last step's weights stay where neither exists."""
        model, last = self.state.model, {"selected_step": step, "selected_by": "the last step"}
        if best["step"] == step:
            return {**last, "selected_by": "the best periodic validation, at the last step"}
        saved = {m["step"]: p for p, m in self._store.complete()}
        if best_weights is not None:
            model.load_state_dict(best_weights)
            if best["step"] not in saved:  # weights only: a resume continues from the last step's checkpoint
                self._store.save(best["step"], model, None, {"selected": True}, val=(best["loss"], best["tokens"]))
        elif best["step"] in saved:  # a resumed run: the best was found before, and checkpointed
            self._store.load(saved[best["step"]], model, None, partial=self.state.partial)
        else:
            return {**last, "selected_by": f"the last step (the best validation, step {best['step']}, came before a "
                                           "resume and has no checkpoint)"}
        return {"selected_step": best["step"], "selected_by": "the best periodic validation"}

    def _say(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)


class RandomState:
    """The generators a step draws from (dropout, data order), as one stateful part."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"], self.device)
