"""The model as a run runs it: what `rpt.parallel.apply.parallelize` returns, and the only thing the trainer calls
to touch the model. One object answers for one process, DDP, the comm modes, DiLoCo, FSDP (`Runner`) and the
pipeline (`PipelineRunner`), so the trainer, telemetry, evaluation and checkpointing hold no branch on any of them:

    runner.bind(optimizer)                       the optimiser the trainer built over runner.owned
    record, state = runner.train_step(x, y, reset, state, step, clock, in_forward)
                                                 forward + backward of every micro-batch (a looped model at
                                                 the step's drawn depth), the wait for the
                                                 gradients, the global norm and clipping, the optimiser step
                                                 (skipped on the device when the norm is not finite), the
                                                 parameters shared back; a StepRecord of what happened
    runner.eval_model()                          what a validation calls: model(x, state, reset, targets)
    runner.model, runner.partial                 the parameters this rank holds (checkpoints, averaging), and
                                                 whether they are a part of the model (a pipeline stage)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from rpt.comm.gradient_sync import GradientSync
from rpt.models.lm import cat_rows, detach_state, rows
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


class Runner:
    """The whole model on this rank, with data parallelism (or none) behind `sync`."""
    partial = False  # checkpoints and initial weights hold the whole model here
    pp, stage_index = 1, 0

    def __init__(self, model: nn.Module, sync: GradientSync, train, device: torch.device, dp_rank: int,
                 dp_size: int, layout: dict, probe: bool = True):
        """`train`: the train section (batch_size, seq_len, grad_accum, grad_clip, precision). `probe`: whether
        telemetry may run a logged step's first tokens through the step forms (not where FSDP shards the blocks:
        that would all-gather every block once per probed token)."""
        self.model, self.sync, self.device = model, sync, device
        self.dp_rank, self.dp_size, self.layout = dp_rank, dp_size, layout
        self.batch_size, self.grad_accum, self.grad_clip = train.batch_size, train.grad_accum, train.grad_clip
        self.tokens_per_step = train.batch_size * train.seq_len * dp_size
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision)
        if self.amp_dtype is not None and device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # what stays float32 (the recurrences) takes TF32 products
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.precision == "fp16")
        self.optimizer: torch.optim.Optimizer | None = None
        self._probe = probe
        self._loop_draw = (model.cfg, train.seed) if model.cfg.loop_core else None

    # ------------------------------------------------------------------ what the trainer calls
    @property
    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank steps (all of them, except under the parameter servers)."""
        return self.sync.owned

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimiser over `owned` (None where this rank owns nothing)."""
        self.optimizer = optimizer
        self.sync.bind(optimizer)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            group["lr"] = lr

    def autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def init_state(self, batch: int) -> list:
        """The recurrent state of this rank's blocks for `batch` rows, at its start."""
        return self.model.init_state(batch, self.device)

    def depth_at(self, step: int) -> int | None:
        """The looped model's depth at training step `step` (None without a loop): the same on every rank."""
        return draw_depth(*self._loop_draw, step) if self._loop_draw is not None else None

    def train_step(self, x, y, reset, state: list, step: int, clock, in_forward) -> tuple[StepRecord, list]:
        """One optimiser step over one batch, the run's step `step`. `clock(phase)` times the phases;
        `in_forward(loss) -> loss` is the step hooks' look at each micro-batch's loss (fault injection)."""
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
        return StepRecord(loss, grad_norm, nonfinite, self.tokens_per_step, comm, depth), state

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

    def eval_model(self) -> nn.Module:
        """What a validation runs: `model(x, state, reset, targets) -> (nats, state)` (nats None on the ranks
        that do not compute the loss)."""
        return self.model

    def finish(self) -> None:
        """The end of training: whatever the mode still owes the replicas (DiLoCo's last outer step)."""
        self.sync.finish()

    def stateful(self) -> dict:
        """What a checkpoint keeps of the running beside the model and optimiser (each `state_dict()`-able)."""
        return {"scaler": self.scaler, "sync": self.sync}

    # ------------------------------------------------------------------ what telemetry reads
    @property
    def comm_mode(self) -> str:
        return self.sync.mode

    @property
    def comm_meter(self):
        return self.sync.meter

    def comm_choice(self) -> dict | None:
        """What comm.mode = "auto" chose by: seconds per step of each mode, modelled and timed (None otherwise)."""
        return self.sync.predictions

    def schedule_in_force(self) -> dict:
        return self.sync.schedule_in_force()

    def probes(self) -> list[tuple[nn.Module, object]]:
        """(model, state_of) pairs the gate probe runs a logged step's first input through (not a looped model's,
        whose state holds each core block once per iteration)."""
        return [(self.model, lambda s: s)] if self._probe and self._loop_draw is None else []

    @property
    def state_layers(self) -> list[int]:
        """The block index of each entry of the state this rank carries (a looped model's core blocks once per
        iteration it holds)."""
        return self.model.state_layers()

    def take_bubble(self) -> dict:
        """{"pipeline_bubble": the pipeline's idle share since the last call}; empty without a pipeline."""
        return {}

    def bubble_by_stage(self, world_size: int) -> dict:
        """The pipeline's idle share per stage over the run, for the summary (empty: no pipeline)."""
        return {}


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
