"""`parallel.fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the mesh's data dimensions.

Each block is a unit (its parameters all-gathered just before its forward and again for its backward, its
gradients reduce-scattered as soon as they are ready), the embedding and the head are units of their own, and
the model (or the pipeline stage) is the root that holds the rest (the norm; a tied embedding and head, which
one unit must own together; a looped model's core blocks and its loop, which run r times a forward: as part of the
root they are gathered once per forward and reduce-scattered once, at the end of backward, where a unit of their
own would be gathered and reduced at every iteration). With replicas as well (`dp x fsdp`, both > 1) it is HSDP:
shards within a replica group, an all-reduce of the shards across them. On gloo every reduction runs as a sum divided
afterwards (`set_force_sum_reduction_for_comms`): gloo's AVG has been wrong for FSDP2 (torch issue 162338).

`FSDPSync` drives it through the trainer's five sync calls: accumulation keeps the gradients unsharded and the
parameters gathered between micro-steps (no communication until the last), and the global gradient norm adds
the local shards' squares over the shard group.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rpt.comm.accounting import fsdp_wire_bytes
from rpt.comm.gradient_sync import GradientSync, clip_global_norm
from rpt.models.lm import Block


def shard(root: nn.Module, model, mesh, precision: str, device: torch.device) -> None:
    """fully_shard the blocks of `model`, its embedding and (untied) head, then `root` (the model itself, or the
    pipeline stage that runs it). bf16 on a GPU: parameters in bf16 for compute, reductions and master
    weights in fp32 (on the CPU, autocast does the casting as without FSDP)."""
    policy = MixedPrecisionPolicy()
    if precision == "bf16" and device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    on = mesh.shard_mesh
    looped = model.loop is not None
    core = range(model.cfg.loop_prelude, model.cfg.loop_prelude + model.cfg.loop_core) if looped else range(0)
    units = [b for k, b in model.blocks.items() if int(k) not in core]
    last = units[-1] if units else None
    tied = model.cfg.tie_embeddings and model.embed is not None and model.head is not None
    if not tied:
        units += [part for part in (model.embed, model.head) if part is not None]
    for unit in units:  # the last block's backward comes at once: it stays gathered (as torchtitan)
        fully_shard(unit, mesh=on, mp_policy=policy, reshard_after_forward=unit is not last)
    fully_shard(root, mesh=on, mp_policy=policy)
    if dist.get_backend() == "gloo":
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


@contextmanager
def gathered(module: nn.Module):
    """`module`'s own parameters unsharded for a forward that does not go through it (pipeline evaluation)."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


class FSDPSync(GradientSync):
    """The sync calls over an FSDP2 model: FSDP communicates inside forward and backward; here the
    accumulation switch, the exposed wait, the norm and the bytes moved."""

    def __init__(self, root: nn.Module, model: nn.Module, mesh, grad_accum: int = 1, reshard_microsteps: bool = False):
        super().__init__(model)
        self.module, self.mesh, self.mode = root, mesh, "fsdp"
        self.device = next(model.parameters()).device
        self.roots = [m for m in root.modules() if isinstance(m, FSDPModule)]
        size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not root]
        blocks = [b for b in units if isinstance(b, Block)]
        own = size(model) - sum(size(u) for u in units)  # the root's own parameters (norm, a tied embedding)
        kept = own + (size(blocks[-1]) if blocks else 0)  # with the last block: gathered once a step
        self.reshard_microsteps = reshard_microsteps
        self.bytes_by_kind = fsdp_wire_bytes(size(model), mesh.fsdp, mesh.replicas, grad_accum, kept,
                                             reshard_microsteps)

    @contextmanager
    def no_sync(self):
        """Inner micro-steps: gradients accumulate unsharded and parameters stay gathered (unless
        `parallel.fsdp_reshard_microsteps`: gathered again each micro-step, to hold less); the last one reduces."""
        for m in self.roots:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(self.reshard_microsteps, recurse=False)
        try:
            yield
        finally:
            for m in self.roots:
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)

    def wait_gradients(self) -> None:
        # FSDP waited for its last reduce-scatter at the end of backward; account the step's traffic by kind
        now = time.perf_counter()
        for kind, sent in enumerate(self.bytes_by_kind.values()):
            self.meter.completed(now, kind, sent)

    def clip_grad_norm(self, max_norm: float, counted: list | None = None, groups: tuple = ()) -> torch.Tensor:
        """The norm of the whole gradient: each rank's shards' squares added over the shard group (and over the
        pipeline ranks in `groups`); every shard scaled alike."""
        counted = self.owned if counted is None else counted
        shards = [LocalGrad(p) for p in counted]
        return clip_global_norm(shards, max_norm, device=self.device, reduce=True,
                                group=(self.mesh.shard_group, *groups))


class LocalGrad:
    """A parameter as clip_global_norm sees it: its local shard's gradient, read and scaled in place."""

    def __init__(self, p: nn.Parameter):
        self.grad = None if p.grad is None else local(p.grad)


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes, in order (a sharded one's whole value): equal digests mean
    bit-identical replicas."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()  # FSDP: the whole parameter
        h.update(full.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
