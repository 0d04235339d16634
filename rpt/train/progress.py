"""How far a run is: its steps, tokens, skipped steps, training seconds over all its segments, what the default
recipe took at its start, and the recurrent state the loop carries. The trainer advances it; a checkpoint saves
it as one part (the trainer itself is no checkpoint part), and a resume loads it back."""

from __future__ import annotations

import time

import torch

from rpt.models.state import map_state, shapes


class Progress:
    def __init__(self, state, layout: dict, device: torch.device, recipe_seconds: float = 0.0):
        """`state`: the fresh recurrent state; `layout`: this rank's place (the runner's layout shape and rank): a
        state saved in another place is another rank's rows and starts afresh."""
        self.step = self.tokens = self.skipped_steps = 0
        self.state, self.layout, self.device = state, layout, device
        self.recipe_seconds = recipe_seconds
        self.elapsed_before, self.started = 0.0, time.perf_counter()  # training seconds of earlier segments; this one's
        self.stopped: float | None = None  # when this segment's training time ended (before the final evaluations)
        self.afresh: str | None = None  # why a resumed state started afresh, where it had to (said at the resume)

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> float:
        """End this segment's training time; its seconds."""
        self.stopped = time.perf_counter()
        return self.stopped - self.started

    def elapsed(self) -> float:
        """Training seconds of this run directory: earlier segments' and this one's."""
        return self.elapsed_before + (self.stopped or time.perf_counter()) - self.started

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
                "elapsed": self.elapsed(), "recipe_seconds": self.recipe_seconds, "state": self.state,
                "layout": self.layout}

    def load_state_dict(self, saved: dict) -> None:
        self.step, self.tokens, self.skipped_steps = saved["step"], saved["tokens"], saved["skipped_steps"]
        self.elapsed_before, self.recipe_seconds = saved["elapsed"], saved["recipe_seconds"]
        if saved["layout"] != self.layout:
            return  # another rank's rows: the recurrent state starts afresh (Checkpointing.resume says so)
        was, now = shapes(saved["state"]), shapes(self.state)
        if was != now:  # another batch size (or state width): each row starts afresh, as the loader's rows do
            self.afresh = (f"the recurrent state starts afresh: it was saved for {was[0][0] if was else 0} rows, "
                           f"this run has {now[0][0] if now else 0} (train.batch_size)")
            return
        self.state = map_state(lambda t: t.to(self.device), saved["state"])
