"""DiLoCo (Douillard et al. 2023, "Distributed Low-Communication Training"): `comm.mode = "diloco"`.

Each rank trains its own replica for H = `comm.diloco_steps` steps with the run's optimiser (the inner one; its
state never leaves the rank). Then the ranks average the pseudo-gradient, the change since the last outer step
(outer - local), and an outer SGD with Nesterov momentum (`comm.diloco_outer_lr`, `comm.diloco_momentum`) moves
the outer parameters by it; every replica restarts from them. Only the outer step communicates: one model's worth
of bytes every H steps, at the width `comm.compression` gives it (none: the parameters' own; fp16, bf16; int8: one scale per
tensor, all-gathered since int8 sums overflow).

Written here rather than taken from torchft: torchft's DiLoCo is built into its fault-tolerance Manager (a
Lighthouse server, its own process groups, a quorum each outer step), none of which an rpt run has; the outer step
itself is a few lines over the run's own process group, behind the same calls as every other mode
(rpt.comm.modes). Periodic validation and best-weight selection see the averaged model only at outer steps, so
config validation asks for `train.eval_interval` in multiples of H.
"""

from __future__ import annotations

import time
import torch
import torch.distributed as dist

from rpt.comm.accounting import allgather_wire_bytes, allreduce_wire_bytes
from rpt.comm.gradient_sync import GradientSync

WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


class DiLoCoSync(GradientSync):
    def __init__(self, model: torch.nn.Module, cfg, world_size: int, group=None):
        super().__init__(model)
        self.world_size, self.group = world_size, group
        self.every, self.wire = cfg.diloco_steps, WIRE[cfg.compression]
        self.inner_steps = 0  # since the last outer step
        self.inner_optimizer = None  # the trainer's, once built (`bind`): its state is this rank's own
        with torch.no_grad():  # every replica starts from rank 0's parameters
            for p in model.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.outer = [p.detach().clone().requires_grad_(True) for p in self.owned]
        momentum = cfg.diloco_momentum
        self.outer_optimizer = torch.optim.SGD(self.outer, lr=cfg.diloco_outer_lr, momentum=momentum,
                                               nesterov=momentum > 0)

    # no_sync and clip_grad_norm: GradientSync's (nothing to hold back; each replica clips its own gradients)

    def bind(self, optimizer) -> None:
        self.inner_optimizer = optimizer

    def share_parameters(self) -> None:
        self.inner_steps += 1
        if self.inner_steps == self.every:
            self.outer_step()

    def finish(self) -> None:
        """The end of training: an outer step over what the last, shorter inner phase learned."""
        if self.inner_steps:
            self.outer_step()
            self.meter.end_step(count=False)

    @torch.no_grad()
    def outer_step(self) -> None:
        waited = time.perf_counter()
        delta = torch.cat([(o - p).reshape(-1) for o, p in zip(self.outer, self.owned)])
        averaged = self._average(delta)
        offset = 0
        for o in self.outer:
            o.grad = averaged[offset:offset + o.numel()].view_as(o).clone()
            offset += o.numel()
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for o, p in zip(self.outer, self.owned):
            p.copy_(o)
        self.inner_steps = 0
        self.meter.add_exposed(time.perf_counter() - waited)  # nothing overlaps it (not streamed)

    def _average(self, delta: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of `delta` (fp32, flat), sent at the wire's width; the bytes counted."""
        start = self.meter.launched()
        if self.wire is torch.int8:
            scales, sizes = [], [o.numel() for o in self.outer]
            for part in delta.split(sizes):
                scales.append(part.abs().max().clamp(min=1e-30) / 127)
            scale = torch.stack(scales)
            q = (delta / scale.repeat_interleave(torch.tensor(sizes))).round().clamp(-127, 127).to(torch.int8)
            qs = [torch.empty_like(q) for _ in range(self.world_size)]
            ss = [torch.empty_like(scale) for _ in range(self.world_size)]
            dist.all_gather(qs, q, group=self.group)
            dist.all_gather(ss, scale, group=self.group)
            total = sum(qr.to(delta.dtype) * sr.repeat_interleave(torch.tensor(sizes)) for qr, sr in zip(qs, ss))
            sent = allgather_wire_bytes(q.nbytes + scale.nbytes, self.world_size)
        else:
            wire = delta.to(self.wire) if self.wire is not None else delta.clone()
            dist.all_reduce(wire, group=self.group)
            total, sent = wire.to(delta.dtype), allreduce_wire_bytes(wire.nbytes, self.world_size)
        self.meter.completed(start, 0, sent)
        return total / self.world_size

    def state_dict(self) -> dict:
        """This rank's own: its replica and inner optimiser state (a checkpoint's model and optimiser are rank 0's,
        written once), the outer parameters and momentum, and where in the inner phase it is."""
        return {"inner_steps": self.inner_steps, "outer": [o.detach().clone() for o in self.outer],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "local": [p.detach().clone() for p in self.owned],
                "inner_optimizer": self.inner_optimizer.state_dict() if self.inner_optimizer is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint of another mode starts a new inner phase from its (replicated) weights."""
        if not state.get("outer"):
            with torch.no_grad():
                for o, p in zip(self.outer, self.owned):
                    o.copy_(p)
            return
        with torch.no_grad():
            for o, saved in zip(self.outer, state["outer"]):
                o.copy_(saved)
            for p, saved in zip(self.owned, state["local"]):
                p.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        if self.inner_optimizer is not None and state["inner_optimizer"] is not None:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_steps = state["inner_steps"]
