"""The base of every gradient-synchronisation mode, and the global gradient norm they all clip by.

A file of its own so that the modes (rpt/comm/modes.py, rpt/comm/diloco.py, rpt/parallel/fsdp.py) build on it
without importing one another.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from rpt.comm.accounting import CommMeter


class GradientSync:
    """The calls every mode answers (rpt/comm/modes.py lists them in order), as one process makes them: nothing to
    synchronise. Each mode (all-reduce, parameter servers, DiLoCo, FSDP) overrides what it does differently."""

    def __init__(self, model: torch.nn.Module):
        self.module, self.meter = model, CommMeter()
        self.owned = [p for p in model.parameters() if p.requires_grad]
        self.mode, self.predictions = "none", None  # the mode in force; auto's seconds per mode (model, timed)

    def no_sync(self):
        return nullcontext()

    def wait_gradients(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_global_norm(self.owned, max_norm)

    def share_parameters(self) -> None:
        pass

    def bind(self, optimizer) -> None:
        """The optimiser the trainer built over `owned` (DiLoCo keeps its state per rank)."""

    def finish(self) -> None:
        """The end of training: whatever a mode still owes the replicas (DiLoCo's last outer step)."""

    def schedule_in_force(self) -> dict:
        """Adaptive synchronisation's current schedule, for the metrics (empty without it)."""
        return {}

    def state_dict(self) -> dict:
        """What this rank's synchronisation carries from step to step (a checkpoint keeps it per rank)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass



def clip_global_norm(counted: list, max_norm: float, *, device=None, reduce: bool = False, group=None,
                     scale: list | None = None) -> torch.Tensor:
    """The global gradient norm: the square root of the summed squares of the `counted` parameters'
    gradients, summed over the ranks of `group` (or of each group of a tuple, in turn) when `reduce` (each rank
    holding a share). When it is
    finite, the gradients of `scale` (default: `counted`) are multiplied by min(1, max_norm / norm).
    Written here rather than torch.nn.utils.clip_grad_norm_ because shards must add up across ranks, and
    because torch's fp32 CPU norm lost 1.6e-4 relative on a 8192 x 64 embedding gradient here (fp32 sums of
    squares agree with a float64 reference to 1e-7), so every mode and pipeline degree now clips alike."""
    grads = [p.grad for p in counted if p.grad is not None]
    if grads:
        total = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    else:
        total = torch.zeros((), device=device)
    if reduce:
        for g in group if isinstance(group, tuple) else (group,):
            dist.all_reduce(total, group=g)
    norm = total.sqrt()
    if max_norm and torch.isfinite(norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in counted if scale is None else scale:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
