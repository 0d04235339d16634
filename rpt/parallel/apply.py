"""What a run asks for, applied from outside the model, in order: the pipeline stage (the model built with the
parts this rank owns), this rank's piece of each window (parallel.cp), exact BPTT in chunks (train.bptt_chunk),
activation checkpointing, compile, then data parallelism (FSDP2 shards, or DDP or a comm mode of rpt.comm) and the
pipeline's schedule around what it wrapped. The model code has no branch for any of them."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rpt.comm.modes import build_sync
from rpt.models import RecurrentLM
from rpt.models.lm import Block
from rpt.parallel import fsdp, pipeline
from rpt.parallel.bptt import chunk_windows
from rpt.parallel.context import ContextGroup, split_windows
from rpt.parallel.mesh import Mesh
from rpt.parallel.pipeline_runner import PipelineRunner
from rpt.parallel.runner import Layout, Runner


def parallelize(cfg, plan, rank: int, world_size: int, device: torch.device, distributed: bool,
                comm_choice: dict | None = None, head_counts=None) -> Runner:
    """This rank's model, built and wrapped as the resolved run asks (`plan`: its pipeline / FSDP plan, from
    choose_layout, or None; `comm_choice`: what comm.mode = "auto" measured; `head_counts`: the corpus's token
    counts, which order a two-level head's shortlist), behind the one object the trainer calls
    (rpt/parallel/runner.py)."""
    t = cfg.train
    mesh = Mesh(device, world_size, plan.pp, plan.fsdp) if plan is not None else None
    staged, sharded = plan is not None and plan.pp > 1, mesh is not None and mesh.fsdp > 1
    torch.manual_seed(t.seed)  # every rank the same initial values; a stage's parts the whole model's
    model = RecurrentLM(cfg.model, pipeline.parts_of(plan, mesh.pp_rank) if staged else None)
    if cfg.model.head_shortlist and head_counts is not None:  # (a resumed run then loads the order it trained with)
        model.order_head(head_counts)
    if not sharded:  # FSDP moves each unit to the device as it shards it: a GPU never holds the whole stage
        model = model.to(device)
    cp = cfg.parallel.cp  # > 1 only on a world it divides (resolve.check_layout)
    if cp > 1:  # a group of cp ranks reads the same rows; the gradients are averaged over every rank
        split_windows(model, ContextGroup(cp, rank, world_size))
    if t.bptt_chunk:
        chunk_windows(model, t.bptt_chunk)
    if cfg.model.activation_checkpointing:
        checkpoint_blocks(model)
    if t.compile:
        compile_blocks(model, t.compile)
    pipe = None
    if staged:
        pipe = pipeline.Pipeline(model, plan, mesh, t.batch_size, t.seq_len, device, cfg.parallel.schedule)
    dp_rank, dp_size = (mesh.dp_rank, mesh.dp) if mesh else (rank // cp, world_size // cp)
    if sharded:  # FSDP2 in place of DDP: the stage (or the model) is the root
        root = pipe.stages[0] if pipe else model
        fsdp.shard(root, model, mesh, t.precision, device)
        sync = fsdp.FSDPSync(root, model, mesh, 1 if pipe else t.grad_accum, cfg.parallel.fsdp_reshard_microsteps)
    else:
        sync = build_sync(model, cfg.comm, rank=dp_rank if mesh else rank,  # without a mesh: every rank (cp x dp)
                          world_size=dp_size if mesh else world_size, distributed=distributed,
                          powersgd_start=t.warmup_steps, seed=t.seed, group=mesh.dp_group if mesh else None,
                          parts=pipe.stages if pipe else None, predictions=comm_choice)
    if pipe:  # the schedule runs each stage as data parallelism wrapped it (one DDP each), or as it is
        pipe.build_schedule(sync.module if isinstance(sync.module, list) else pipe.stages)
    shape = {"pp": mesh.pp, "dp": mesh.replicas, "fsdp": mesh.fsdp} if mesh else {"pp": 1, "dp": dp_size, "fsdp": 1}
    if cp > 1:
        shape["cp"] = cp
    layout = Layout(rank, world_size, distributed, device, shape, dp_rank, dp_size, cfg.model.n_layers,
                    tuple(pipe.layers if pipe else model.state_layers()), sync.mode, sync.predictions, t.precision,
                    pp=plan.pp if pipe else 1, stage_index=pipe.index if pipe else 0)
    if pipe:
        return PipelineRunner(pipe, sync, t, layout, probe=not sharded)
    return Runner(model, sync, t, layout, probe=not sharded and cp == 1)


def choose_layout(cfg, rank: int, world_size: int, device: torch.device, local_world: int = 1):
    """The plan for this job (printed by rank 0) when it has pipeline stages or FSDP shards; None for plain data
    parallelism. Pipelines balance their stages by costs timed on this device at start (a collective)."""
    from rpt.parallel.plan import choose_plan, device_memory_bytes, format_plan

    p = cfg.parallel
    if p.pp == 1 and p.fsdp == 1:
        return None
    costs = pipeline.measure_costs(cfg.model, cfg.train.batch_size // p.microbatches, cfg.train.seq_len,
                                   device) if p.pp != 1 else None
    plan = choose_plan(cfg, world_size, device_memory_bytes(device, local_world), costs)
    if rank == 0:
        print(format_plan(plan), flush=True)
    return None if plan.pp == 1 and plan.fsdp == 1 else plan


def checkpoint_blocks(model: nn.Module) -> None:
    """model.activation_checkpointing: each block keeps only its inputs for backward and runs its forward again
    there (non-reentrant: custom operators and dropout's random numbers replay). Set on the block itself, so that
    a compiled block (train.compile, applied after this) holds the checkpoint in its graph."""
    for block in model.modules():
        if isinstance(block, Block):
            block.forward = partial(_recomputed, block.forward)


def _recomputed(forward, x, state, reset=None, step: bool = False):
    if step or not torch.is_grad_enabled():
        return forward(x, state, reset, step)
    return checkpoint(forward, x, state, reset, use_reentrant=False)


def compile_blocks(model: nn.Module, backend: str) -> None:
    """torch.compile each block in place, as torchtitan does: blocks of one shape share their compiled code, and
    the embedding, head and loss stay eager; in place, so parameter names and checkpoints are the eager model's.
    Graph breaks are allowed: rpt's kernels trace whole, but lstm (and gru on a GPU) runs torch's own kernel
    eagerly inside the block (cells/base.py, over_segments)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(backend=backend)
