"""Adaptive synchronisation: important parameter groups every step, minor ones every N steps.

A group is the module that owns a parameter (`blocks.3.cell`, `embed`, `norm`, ...). Until the
first re-ranking every group synchronises every step while each rank adds up, per group, the
squared norm of its local gradient divided by the group's size (so a large matrix does not win
by its size alone). Every `interval` steps the ranks sum those statistics with one small
all-reduce, so every rank ranks the groups identically (ranks that disagreed would issue
different collectives and hang); the top `keep` share, plus the pinned groups, stay important.

A minor group synchronises every `period` steps, staggered by its rank in the ordering so the
savings spread over the steps. In between, each rank adds its gradient into a local buffer and
the group's parameters take no optimiser step at all (their gradient is removed after backward),
so the replicas never diverge. At its synchronisation step the group sends the mean of the
gradients accumulated since its last one, and AdamW steps it once: a larger batch for that group.

It runs as a DDP communication hook: per bucket, only the slices of groups that synchronise
this step are packed and all-reduced, so the bytes saved are real bytes not sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rpt.comm.accounting import CommMeter, allreduce_wire_bytes
from rpt.config import CommConfig


def group_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


class AdaptiveSchedule:
    def __init__(self, model: torch.nn.Module, cfg: CommConfig, meter: CommMeter, world_size: int, group=None):
        self.cfg, self.meter, self.world_size, self.group = cfg, meter, world_size, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.groups = sorted({group_of(n) for n, _ in named})
        self.group_index = {id(p): self.groups.index(group_of(n)) for n, p in named}
        self.params = dict(named)  # by name: the checkpoint keys the held sums by name
        self.pinned = {g for g in self.groups if any(g.startswith(prefix) for prefix in cfg.adaptive_pin)}
        self.period = {g: 1 for g in self.groups}   # the schedule in force: steps between synchronisations
        self.offset = {g: 0 for g in self.groups}
        self.scores = torch.zeros(len(self.groups), dtype=torch.float64)
        self.pending: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) -> (local gradient sum, steps)
        self.held_back: list[torch.nn.Parameter] = []          # params whose gradient waits this step
        self.step = 0

    # ------------------------------------------------------------------ the hook
    def syncs(self, group: str) -> bool:
        return (self.step + self.offset[group]) % self.period[group] == 0

    def hook(self, _state, bucket):
        grads, params = bucket.gradients(), bucket.parameters()
        send = []
        for p, g in zip(params, grads):
            gi = self.group_index[id(p)]
            if self.scores.device != g.device:  # kept where the gradients are: no host sync in backward
                self.scores = self.scores.to(g.device)
            self.scores[gi] += g.detach().double().pow(2).sum() / g.numel()
            acc, steps = self.pending.pop(id(p), (None, 0))
            if self.syncs(self.groups[gi]):
                if acc is not None:
                    g.add_(acc).div_(steps + 1)  # the mean of the gradients since the group's last sync
                send.append(g)
            else:
                self.pending[id(p)] = (g.detach().clone() if acc is None else acc.add_(g), steps + 1)
                self.held_back.append(p)
        flat = torch.cat([g.reshape(-1) for g in send]).div_(self.world_size) if send else None
        start = self.meter.launched()
        if flat is None:
            self.meter.completed(start, bucket.index(), 0)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        wire = allreduce_wire_bytes(flat.nbytes, self.world_size)

        def unpack(f):
            self.meter.completed(start, bucket.index(), wire)
            reduced, offset = f.value()[0], 0
            for g in send:
                g.copy_(reduced[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            return bucket.buffer()
        return dist.all_reduce(flat, group=self.group, async_op=True).get_future().then(unpack)

    # ------------------------------------------------------------------ after backward
    def after_backward(self) -> None:
        """Remove the held-back gradients (no optimiser step for them) and re-rank when it is time."""
        for p in self.held_back:
            p.grad = None
        self.held_back = []
        self.step += 1
        if self.step % self.cfg.adaptive_interval == 0:
            self._rerank()

    def _rerank(self) -> None:
        scores = self.scores.clone()
        dist.all_reduce(scores, group=self.group)  # every rank ranks the same numbers
        scores = scores.cpu()
        self.scores.zero_()
        order = sorted(range(len(self.groups)), key=lambda i: (-float(scores[i]), self.groups[i]))
        keep = max(1, round(self.cfg.adaptive_keep * len(self.groups)))
        important = {self.groups[i] for i in order[:keep]} | self.pinned
        minor = [self.groups[i] for i in order if self.groups[i] not in important]
        for g in self.groups:
            self.period[g], self.offset[g] = 1, 0
        for k, g in enumerate(minor):
            self.period[g], self.offset[g] = self.cfg.adaptive_period, k % self.cfg.adaptive_period

    def state_dict(self) -> dict:
        """This rank's schedule and accumulators (the scores and the held gradient sums are its own), with the
        held sums keyed by parameter name."""
        name = {id(p): n for n, p in self.params.items()}
        return {"step": self.step, "period": self.period, "offset": self.offset, "scores": self.scores.cpu(),
                "pending": {name[i]: (acc.cpu(), steps) for i, (acc, steps) in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.period, self.offset = state["step"], state["period"], state["offset"]
        device = next(iter(self.params.values())).device
        self.scores = state["scores"].to(device)
        self.pending = {id(self.params[n]): (acc.to(device), steps) for n, (acc, steps) in state["pending"].items()}

    def in_force(self) -> dict:
        """The schedule for the metrics: which groups wait, and every how many steps."""
        return {"adaptive_step": self.step,
                "adaptive_minor": sorted(g for g in self.groups if self.period[g] > 1),
                "adaptive_period": self.cfg.adaptive_period}
