"""The model as a run runs it: what `rpt.parallel.apply.parallelize` returns, and the only thing the trainer calls
to touch the model. One object answers for one process, DDP, the comm modes, DiLoCo, FSDP (`Runner`) and the
pipeline (`PipelineRunner`), so the trainer, telemetry, evaluation and checkpointing hold no branch on any of them.
The trainer calls eight names:

    runner.layout                                this rank's place (Layout: immutable; what telemetry shows and a
                                                 checkpoint records)
    runner.probes()                              the blocks the gate probe may run a logged step's tokens through
    runner.bind(make_optimizer)                  the optimiser, made over the parameters this rank steps
    runner.init_state(batch)                     the recurrent state of this rank's blocks
    record, state = runner.train_step(x, y, reset, state, step, lr, clock, in_forward)
                                                 forward + backward of every micro-batch (a looped model at
                                                 the step's drawn depth), the wait for the gradients, the
                                                 global norm and clipping, the optimiser step at `lr` (skipped
                                                 on the device when the norm is not finite), the parameters
                                                 shared back; a StepRecord of what happened
    runner.eval_model()                          what a validation calls: model(x, state, reset, targets)
    runner.checkpoint_state()                    what a checkpoint holds of the running (CheckpointState)
    runner.finish()                              the end of training; the run's figures only the runner knows
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from rpt.comm.gradient_sync import GradientSync
from rpt.models.state import cat_rows, detach_state, rows
from rpt.models.loop import draw_depth


@dataclass
class StepRecord:
    """One optimiser step, as telemetry and the trainer's bookkeeping read it."""
    loss: torch.Tensor  # the batch's mean loss in nats (0-d, on the device: read only at log lines)
    grad_norm: torch.Tensor  # the global gradient norm before clipping (0-d)
    nonfinite: torch.Tensor  # 0-d bool: the norm was not finite and the optimiser step was skipped
    tokens: int  # tokens the step trained on, over every data-parallel rank
    comm: dict  # this step's communication figures (rpt.comm.accounting.CommMeter.end_step)
    depth: int | None = None  # a looped model's drawn depth (model.loop_core)
    schedule: dict = field(default_factory=dict)  # adaptive synchronisation's schedule in force (comm.adaptive)
    stage_seconds: tuple[float, float] | None = None  # a pipeline stage's (compute, wall) seconds of this step


@dataclass(frozen=True)
class Layout:
    """This rank's place in the run, fixed once the runner is built: what telemetry shows (ranks, stages, the
    communication mode) and a checkpoint records (`shape`: pp, dp, fsdp and cp, which a resume compares)."""
    rank: int
    world_size: int
    distributed: bool
    device: torch.device
    shape: dict
    dp_rank: int
    dp_size: int
    n_layers: int
    state_layers: tuple[int, ...]  # the block of each entry of the state this rank carries
    comm_mode: str
    comm_choice: dict | None  # what comm.mode = "auto" chose by: seconds per step of each mode (None otherwise)
    precision: str
    pp: int = 1
    stage_index: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def autocast_for(precision: str, device: torch.device):
    """The autocast context of `precision` on `device` (none for fp32): training's, and validation's."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@dataclass
class CheckpointState:
    """What a checkpoint holds, as one provider (rpt/train/checkpoint/manager.py): the model (this rank's part of
    it where `partial`), its optimiser, and every other part with state (name -> `state_dict()` /
    `load_state_dict()`); `per_rank` names the parts that belong to one rank's place, which start afresh when a
    checkpoint is resumed on another layout."""
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    parts: dict
    partial: bool = False
    per_rank: tuple[str, ...] = ()

    def with_parts(self, parts: dict, per_rank: tuple[str, ...] = ()) -> "CheckpointState":
        return CheckpointState(self.model, self.optimizer, {**self.parts, **parts}, self.partial,
                               (*self.per_rank, *per_rank))


class Runner:
    """The whole model on this rank, with data parallelism (or none) behind `sync`."""
    partial = False  # checkpoints and initial weights hold the whole model here

    def __init__(self, model: nn.Module, sync: GradientSync, train, layout: Layout, probe: bool = True):
        """`train`: the train section (batch_size, seq_len, grad_accum, grad_clip, precision). `probe`: whether
        telemetry may run a logged step's first tokens through the step forms (not where FSDP shards the blocks:
        that would all-gather every block once per probed token)."""
        self.model, self.sync, self.layout, self.device = model, sync, layout, layout.device
        self.batch_size, self.grad_accum, self.grad_clip = train.batch_size, train.grad_accum, train.grad_clip
        self.tokens_per_step = train.batch_size * train.seq_len * layout.dp_size
        self.precision = train.precision
        if self.precision in ("bf16", "fp16") and self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # what stays float32 (the recurrences) takes TF32 products
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=train.precision == "fp16")
        self.optimizer: torch.optim.Optimizer | None = None
        self._probe = probe
        self._loop_draw = (model.cfg, train.seed) if model.cfg.loop_core else None

    # ------------------------------------------------------------------ what the trainer calls
    @property
    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank steps (all of them, except under the parameter servers)."""
        return self.sync.owned

    def bind(self, make_optimizer) -> None:
        """The optimiser: `make_optimizer(model, only=owned)` over the parameters this rank steps (None where it owns
        none)."""
        self.optimizer = make_optimizer(self.model, only=self.owned)
        self.sync.bind(self.optimizer)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            group["lr"] = lr

    def autocast(self):
        return autocast_for(self.precision, self.device)

    def init_state(self, batch: int) -> list:
        """The recurrent state of this rank's blocks for `batch` rows, at its start."""
        return self.model.init_state(batch, self.device)

    def depth_at(self, step: int) -> int | None:
        """The looped model's depth at training step `step` (None without a loop): the same on every rank."""
        return draw_depth(*self._loop_draw, step) if self._loop_draw is not None else None

    def train_step(self, x, y, reset, state: list, step: int, lr: float | None, clock,
                   in_forward) -> tuple[StepRecord, list]:
        """One optimiser step over one batch, the run's step `step`, at learning rate `lr` (None: as it was).
        `clock(phase)` times the phases; `in_forward(loss) -> loss` is the step hooks' look at each micro-batch's
        loss (fault injection)."""
        if lr is not None:
            self.set_lr(lr)
        pin = self.device.type == "cuda"  # a copy from pageable memory would wait for the queued kernels
        x, y, *reset = ((v.pin_memory() if pin else v).to(self.device, non_blocking=True)
                        for v in (x, y, *(() if reset is None else (reset,))))
        depth = self.depth_at(step)
        loss, state = self._forward_backward(x, y, reset[0] if reset else None, state, depth, clock, in_forward)
        with clock("optimizer"):
            self.sync.wait_gradients()
            if self.optimizer is not None:
                self.scaler.unscale_(self.optimizer)
            grad_norm = self._clip_grad_norm()
            nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank: the norm is global
            if self.optimizer is not None:
                if self.scaler.is_enabled():  # fp16: the scaler hands fused AdamW its own overflow flag
                    self.scaler.step(self.optimizer)
                else:
                    step_unless(self.optimizer, nonfinite)
                self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            self.sync.share_parameters()  # a skipped step shares unchanged parameters
            comm = self.sync.meter.end_step()
        return StepRecord(loss, grad_norm, nonfinite, self.tokens_per_step, comm, depth,
                          self.sync.schedule_in_force(), self._stage_seconds()), state

    def _forward_backward(self, x, y, reset, state, depth, clock, in_forward) -> tuple[torch.Tensor, list]:
        """Forward and backward of each micro-batch (rows of the batch), synchronised on the last only."""
        micro, losses, states, module = self.batch_size // self.grad_accum, [], [], self.sync.module
        for k in range(self.grad_accum):
            part = slice(k * micro, (k + 1) * micro)
            with nullcontext() if k == self.grad_accum - 1 else self.sync.no_sync():
                with self.autocast(), clock("forward"):
                    nats, new = module(x[part], rows(state, part), None if reset is None else reset[part], y[part],
                                       **({} if depth is None else {"depth": depth}))
                    loss = in_forward(nats.mean())
                with clock("backward"):
                    self.scaler.scale(loss / self.grad_accum).backward()
            losses.append(loss.detach())
            states.append(detach_state(new))
        return torch.stack(losses).mean(), cat_rows(states)

    def _clip_grad_norm(self) -> torch.Tensor:
        return self.sync.clip_grad_norm(self.grad_clip)

    def _stage_seconds(self) -> tuple[float, float] | None:
        return None  # no pipeline

    def eval_model(self) -> nn.Module:
        """What a validation runs: `model(x, state, reset, targets) -> (nats, state)` (nats None on the ranks
        that do not compute the loss)."""
        return self.model

    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint keeps of the running: the model, the optimiser, the loss scaler and the
        synchronisation's state (a rank's own: codec residuals, DiLoCo's outer state)."""
        return CheckpointState(self.model, self.optimizer, {"scaler": self.scaler, "sync": self.sync}, self.partial,
                               per_rank=("sync",))

    def finish(self) -> dict:
        """The end of training: whatever the mode still owes the replicas (DiLoCo's last outer step); then the
        run's figures that only the runner holds, for the summary: this rank's communication totals (steps, bytes,
        seconds, exposed seconds) and, for a pipeline, its idle share by stage (a collective: every rank calls
        this at the same point)."""
        self.sync.finish()
        m = self.sync.meter
        return {"comm_totals": (m.steps, m.total_bytes, m.total_seconds, m.total_exposed)}

    def probes(self) -> list[tuple[nn.Module, object]]:
        """(model, state_of) pairs the gate probe runs a logged step's first input through (not a looped model's,
        whose state holds each core block once per iteration)."""
        return [(self.model, lambda s: s)] if self._probe and self._loop_draw is None else []


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """The optimiser's step, skipped on the device where `nonfinite` (a 0-d bool tensor) is set.

    Fused AdamW and SGD read a `found_inf` tensor (GradScaler hands fp16 steps the same way) and then leave
    parameters, moments and step counts untouched, so the host never waits for the gradient norm:
    on a GPU the next step's kernels queue behind this one instead of after a synchronisation.
    """
    optimizer.found_inf = nonfinite.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
