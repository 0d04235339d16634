"""The parallel plan: pipeline and data-parallel degrees, blocks per stage, and what each rank holds.

Nothing runs and nothing is allocated: the model is built on the meta device, each block's cost is
its counted matrix FLOPs per token (`flops_per_token`, recurrent products included), and the
activation memory of a block is measured on two narrow copies of it (bytes autograd saves for
backward, at widths 8h and 16h with the real sequence length) and extrapolated linearly to the real
width. A 10-billion-parameter configuration on 4096 ranks plans in about a second.

Partitioning is a min-max split of the block costs into contiguous stages, the embedding charged to
the first stage and the output layer to the last; among equally good splits the one with the most
even stage costs wins (12 equal blocks on 3 stages: 4 + 4 + 4).

Memory per rank (fp32 master weights, gradients and AdamW state, 16 bytes per parameter; the
parameter-server modes move the optimiser state as they do in training; FSDP keeps 1 / fsdp of all three and
gathers one unit at a time) plus activations of the micro-batches in flight (of a window's piece, with
context parallelism): 1F1B keeps min(m, pp - s) on stage s, GPipe all m. The output layer's
logits (and their softmax for the loss) are charged to the last stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch

from rpt.config import Config
from rpt.errors import RptError
from rpt.comm.accounting import allreduce_wire_bytes, fsdp_wire_bytes
from rpt.models.loop import mean_depths
from rpt.models.shapes import on_meta

GiB = 2**30
_ACTIVATIONS: dict[tuple, float] = {}  # (model config, seq_len, has attention) -> saved bytes per token


@dataclass
class StagePlan:
    index: int
    blocks: tuple[int, int]   # [start, stop) block indices
    cost: float               # per token of this stage, embedding / head included (FLOPs, or measured seconds)
    params: int
    memory: dict = field(default_factory=dict)  # bytes per rank: weights, grads, optimizer, activations, total


@dataclass
class Plan:
    world_size: int
    pp: int
    dp: int                       # data-parallel ranks of a stage: replicas x fsdp
    microbatches: int
    schedule: str
    params: int
    stages: list[StagePlan]
    grad_bytes_per_step: dict     # comm mode -> bytes the busiest rank sends per step over the dp dimension
    pipeline_bytes_per_step: int  # activations + their gradients a middle stage sends per step
    device_memory: int
    bubble_theory: float          # idle share (p - 1) / (v m + p - 1): v = 1 for 1F1B and GPipe
    cost_unit: str = "FLOP"       # how the stages were balanced: counted FLOPs, or seconds measured at start
    stages_per_rank: int = 1      # v: virtual stages per rank (interleaved); stage j runs on pipeline rank j % pp
    fsdp: int = 1                 # ranks sharding each stage's parameters, gradients and optimiser state
    mode: str = "allreduce"       # the comm.mode counted (auto: as allreduce); "fsdp" when fsdp > 1
    fsdp_bytes_per_step: dict = field(default_factory=dict)  # all_gather, reduce_scatter, replica_all_reduce
    loop_blocks: tuple[int, int] = (0, 0)  # a looped model's core [start, stop): always inside one stage
    cp: int = 1                   # ranks that split each window (context parallelism; pp = fsdp = 1)
    context_bytes_per_step: int = 0  # states and their gradients a middle rank of a cp group sends per step

    @property
    def replicas(self) -> int:
        return self.dp // self.fsdp

    def rank_stages(self, pp_rank: int) -> list[StagePlan]:
        return self.stages[pp_rank::self.pp]

    @property
    def peak_memory(self) -> int:
        return max(sum(s.memory["total"] for s in self.rank_stages(r)) for r in range(self.pp))

    @property
    def fits(self) -> bool:
        return self.peak_memory <= 0.9 * self.device_memory

    def as_dict(self) -> dict:
        return {**asdict(self), "replicas": self.replicas, "peak_memory": self.peak_memory, "fits": self.fits,
                "bytes_per_step": self.bytes_per_step}

    @property
    def bytes_per_step(self) -> int:
        """What the busiest rank sends a step in the mode the config asks for, pipeline activations and context
        states included."""
        return self.grad_bytes_per_step[self.mode] + self.pipeline_bytes_per_step + self.context_bytes_per_step


def balance(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage: contiguous, at least one each, minimising the costliest stage, then the spread."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise RptError(f"cannot split {n} blocks into {stages} pipeline stages", f"use parallel.pp <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    # best[s][j]: (max cost, sum of squared costs, cut) of the first j blocks on stages 0..s
    inf = (math.inf, math.inf, -1)
    best = [[inf] * (n + 1) for _ in range(stages)]
    for j in range(1, n - stages + 2):
        c = stage_cost(0, 0, j)
        best[0][j] = (c, c * c, 0)
    for s in range(1, stages):
        for j in range(s + 1, n - stages + s + 2):
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                c = stage_cost(s, i, j)
                cand = (max(prev[0], c), prev[1] + c * c, i)
                if cand[:2] < best[s][j][:2]:
                    best[s][j] = cand
    counts, j = [], n
    for s in range(stages - 1, -1, -1):
        i = best[s][j][2]
        counts.append(j - i)
        j = i
    return counts[::-1]


def _meta_model(cfg: Config):
    from rpt.models import RecurrentLM

    if cfg.model.vocab_size <= 0:
        raise RptError("model.vocab_size is not set", "take it from the data (meta.json) or set model.vocab_size")
    with on_meta():
        return RecurrentLM(cfg.model)


def gradient_bytes(cfg: Config) -> int:
    """fp32 gradient bytes of the configured model, counted on the meta device (nothing allocated)."""
    return 4 * sum(p.numel() for p in _meta_model(cfg).parameters() if p.requires_grad)


def activation_bytes_per_token(cfg: Config, block_index: int) -> float:
    """Bytes autograd saves for backward per token in one block (fp32), measured on narrow copies."""
    from rpt.models.lm import Block

    m, heads = cfg.model, max(1, cfg.model.attention_heads)
    T = cfg.train.seq_len
    samples = []
    for width in (8 * heads, 16 * heads):
        small = dataclasses.replace(m, d_model=width, d_hidden=m.d_hidden * width // m.d_model if m.d_hidden else 0,
                                    activation_checkpointing=False)  # what the block saves when it runs in full
        block = Block(small, block_index)
        saved = []
        x = torch.randn(1, T, width, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            block(x, block.init_state(1), None)
        samples.append((width, sum(saved) / T))
    (w1, b1), (w2, b2) = samples
    slope = (b2 - b1) / (w2 - w1)
    return max(0.0, b1 + slope * (m.d_model - w1))


@dataclass
class Costs:
    """Seconds (or FLOPs) per token of each piece: blocks by whether they hold attention, embedding, output."""
    block: dict[bool, float]
    embed: float
    head: float
    unit: str = "FLOP"


def counted_costs(cfg: Config, model=None) -> Costs:
    """Training FLOPs per token from the model's own count (rpt plan: nothing runs)."""
    model = model if model is not None else _meta_model(cfg)
    block = {}
    for b in model.blocks.values():
        block.setdefault(b.attn is not None, 3.0 * b.flops_per_token())
    m = cfg.model
    return Costs(block, embed=3.0 * m.d_model, head=3.0 * 2 * m.d_model * m.vocab_size)


def make_plan(cfg: Config, world_size: int, pp: int, device_memory: int, costs: Costs | None = None,
              fsdp: int = 1, model=None) -> Plan:
    """The plan for `pp` stages, each sharded over `fsdp` ranks; `costs` measured at start by training, else
    counted FLOPs; `model`: the meta model, when the caller has built it."""
    cp = cfg.parallel.cp
    if world_size % (pp * cp) or (world_size // pp) % fsdp:
        raise RptError(f"world size {world_size} is not divisible by parallel.pp x parallel.fsdp x parallel.cp = "
                       f"{pp} x {fsdp} x {cp}", "choose pipeline, FSDP and context degrees whose product divides "
                       "the number of ranks")
    model = model if model is not None else _meta_model(cfg)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    dp, micro = world_size // (pp * cp), p.microbatches
    costs = costs or counted_costs(cfg, model)
    looped = loop_factors(m)  # a looped model's core blocks: run r times forward, k times backward
    block_costs = [costs.block[b.attn is not None] * looped.get(int(k), (1.0, 1.0))[0]
                   for k, b in model.blocks.items()]
    head_cost, embed_cost = costs.head, costs.embed
    v = p.stages_per_rank if p.schedule == "interleaved" else 1
    n = pp * v  # stages of the pipeline; rank r runs stages r, r + pp, ...
    core = (m.loop_prelude, m.loop_prelude + m.loop_core) if m.loop_core else (0, 0)
    counts = balance_keeping(block_costs, n, embed_cost, head_cost, core)
    tokens_per_micro = t.batch_size // micro * t.seq_len // cp  # a cp rank runs its piece of each window
    embed_params = model.embed.weight.numel()
    block_params = [sum(q.numel() for q in b.parameters()) for b in model.blocks.values()]
    stages, start = [], 0
    for s, count in enumerate(counts):
        params = sum(block_params[start:start + count])
        params += sum(q.numel() for q in model.norm.parameters()) if s == n - 1 else 0
        holds_core = m.loop_core and start <= core[0] < start + count
        params += sum(q.numel() for q in model.loop.parameters()) if holds_core else 0
        params += embed_params if s == 0 else 0
        head = model.head.weight.numel() if s == n - 1 and (pp > 1 or not m.tie_embeddings) else 0
        params += head
        act = recompute = 0.0  # bytes per token kept per micro-batch in flight; one block's, while it recomputes
        for b in range(start, start + count):
            key = (repr(m), t.seq_len, model.blocks[str(b)].attn is not None)  # blocks differ only by attention
            if key not in _ACTIVATIONS:
                _ACTIVATIONS[key] = activation_bytes_per_token(cfg, b)
            if m.activation_checkpointing:  # a block keeps its input; backward rebuilds the rest, one at a time
                act += 4 * m.d_model * looped.get(b, (1.0, 1.0))[1]
                recompute = max(recompute, _ACTIVATIONS[key])
            else:
                act += _ACTIVATIONS[key] * looped.get(b, (1.0, 1.0))[1]
        if s == n - 1:
            act += 2 * 4 * m.vocab_size  # logits and their log-softmax, fp32
        in_flight = micro if p.schedule == "gpipe" else min(micro, n - s)  # interleaved: an estimate
        cost = (sum(block_costs[start:start + count]) + (embed_cost if s == 0 else 0)
                + (head_cost if s == n - 1 else 0))
        activations = (act * in_flight + recompute) * tokens_per_micro
        # FSDP's units (rpt/parallel/fsdp.py): each block outside a loop's core, an untied embedding and head; the
        # root gathers the rest at once (the core, which runs as one loop, the norms, a tied embedding)
        units = [block_params[b] for b in range(start, start + count) if not core[0] <= b < core[1]]
        units += [embed_params if s == 0 else 0, head] if not (m.tie_embeddings and pp == 1) else []
        units.append(params - sum(units))
        stages.append(StagePlan(s, (start, start + count), cost, params,
                                _memory(params, activations, cfg.comm.mode, dp, fsdp, max(units))))
        start += count
    busiest = max(range(pp), key=lambda r: sum(c.params for c in stages[r::pp]))
    grad = 4 * sum(c.params for c in stages[busiest::pp])
    synced = dp * cp  # a cp group's ranks average their gradients with every other rank's
    share = (synced - 1) * grad // synced if synced > 1 else 0
    if fsdp > 1:
        kept = 4 * sum(block_params[c.blocks[1] - 1] for c in stages[busiest::pp])  # last blocks: gathered once
        by_kind = fsdp_wire_bytes(grad, fsdp, dp // fsdp, t.grad_accum, kept, p.fsdp_reshard_microsteps)
        grad_bytes = {"fsdp": sum(by_kind.values())}
    else:
        by_kind = {}
        grad_bytes = {"allreduce": allreduce_wire_bytes(grad, synced) if synced > 1 else 0,
                      "ps": (synced - 1) * grad if synced > 1 else 0,  # the server sends every worker the parameters
                      "ps-sharded": 2 * share}                          # gradients to the owners, parameters back
    pipe_bytes = 2 * 4 * t.batch_size * t.seq_len * m.d_model if pp > 1 else 0
    mode = "fsdp" if fsdp > 1 else cfg.comm.mode if cfg.comm.mode in grad_bytes else "allreduce"
    return Plan(world_size, pp, dp, micro, p.schedule, model.num_params(), stages, grad_bytes, pipe_bytes,
                device_memory, (pp - 1) / (v * micro + pp - 1), costs.unit, v, fsdp, mode, by_kind, core, cp,
                context_bytes(model, t.batch_size, cp))


def context_bytes(model, rows: int, cp: int) -> int:
    """What a middle rank of a cp group sends a step (rpt/parallel/context.py), fp32: a cell that summarises its
    piece (its `piece_forward`), the all-gather of its summary and the all-reduce of their gradients; every other
    cell's and attention's state to the next rank, and the gradient of the state it received to the one before."""
    if cp == 1:
        return 0
    total = 0
    for block in model.blocks.values():
        cell = block.cell
        if cell.piece_forward is not None:
            summary = 4 * rows * cell.summary_numbers()
            total += summary * (cp - 1) + allreduce_wire_bytes(cp * summary, cp)
        else:
            total += 2 * 4 * rows * cell.state_numbers()
        if block.attn is not None:
            total += 2 * 4 * rows * block.attn.window * (2 * block.attn.d_model + 1)
    return total


def balance_keeping(costs: list[float], stages: int, first_extra: float, last_extra: float,
                    together: tuple[int, int]) -> list[int]:
    """`balance` with the blocks [start, stop) of `together` (a looped model's core, which runs as one loop) in one
    stage: they are balanced as one block of their summed cost."""
    a, b = together
    if b - a <= 1:
        return balance(costs, stages, first_extra, last_extra)
    items = costs[:a] + [sum(costs[a:b])] + costs[b:]
    if stages > len(items):
        raise RptError(f"cannot split {len(costs)} blocks into {stages} pipeline stages with the loop's core (blocks "
                       f"{a} to {b - 1}) inside one stage: {len(items)} stages at most",
                       f"use parallel.pp <= {len(items)} (x parallel.stages_per_rank, interleaved), or fewer core "
                       "blocks (model.loop_core)")
    counts, start = balance(items, stages, first_extra, last_extra), 0
    for s, count in enumerate(counts):
        if start <= a < start + count:
            counts[s] += b - a - 1
        start += count
    return counts


def loop_factors(m) -> dict[int, tuple[float, float]]:
    """For each core block of a looped model (model.loop_core): its training FLOPs over an unlooped block's
    ((mean r forward + 2 x mean min(r, k) backward) / 3) and the copies of its activations a step keeps (mean
    min(r, k): the first r - k iterations keep none). Empty without a loop."""
    if not m.loop_core:
        return {}
    runs, kept = mean_depths(m)
    return {b: ((runs + 2 * kept) / 3, kept) for b in range(m.loop_prelude, m.loop_prelude + m.loop_core)}


def _memory(params: int, activations: float, mode: str, dp: int, fsdp: int = 1, largest_unit: int = 0) -> dict:
    """Bytes per rank: fp32 weights and gradients, AdamW's two moments; FSDP keeps 1 / fsdp of each and, while it
    works, the largest unit whole (its parameters and the next unit's, prefetched, and its gradient before the
    reduce-scatter)."""
    weights, grads, optimizer = 4 * params, 4 * params, 8 * params
    if mode == "ps-sharded" and dp > 1:
        optimizer = math.ceil(8 * params / dp)
    mem = {"weights": weights, "grads": grads, "optimizer": optimizer}
    if fsdp > 1:
        mem = {k: math.ceil(v / fsdp) for k, v in mem.items()}
    mem["gathered"] = 3 * 4 * largest_unit if fsdp > 1 else 0
    mem["activations"] = int(activations)
    mem["total"] = sum(mem.values())
    return mem


def candidate_degrees(world_size: int, n_layers: int) -> list[int]:
    return [k for k in range(1, min(world_size, n_layers) + 1) if world_size % k == 0]


def choose_plan(cfg: Config, world_size: int, device_memory: int, costs: Costs | None = None) -> Plan:
    """`parallel.pp` and `parallel.fsdp`, as set or "auto": the fewest pipeline stages (the least bubble) with
    which some FSDP degree fits the device, and then the smallest FSDP degree that fits. At a given pp that is
    also the least traffic: a rank sends 2 (n - 1) / n of its stage's gradients under DDP, and under FSDP
    3 (f - 1) / f of its parameters (two all-gathers and a reduce-scatter) plus 2 / f across the replicas,
    which grows with f; pipelines deeper than needed send fewer gradient bytes but idle longer."""
    p = cfg.parallel
    n_data = lambda pp: world_size // pp  # noqa: E731
    pps = candidate_degrees(world_size, cfg.model.n_layers) if p.pp == "auto" else [int(p.pp)]
    model, last = _meta_model(cfg), None
    for pp in pps:
        if world_size % pp:
            break  # make_plan explains
        fsdps = [k for k in range(1, n_data(pp) + 1) if n_data(pp) % k == 0] if p.fsdp == "auto" else [int(p.fsdp)]
        for fsdp in fsdps:
            last = make_plan(cfg, world_size, pp, device_memory, costs, fsdp, model)
            if last.fits or (p.pp != "auto" and p.fsdp != "auto"):
                return last
    if last is None:
        return make_plan(cfg, world_size, pps[0], device_memory, costs, 1 if p.fsdp == "auto" else int(p.fsdp), model)
    need = f"{last.peak_memory / GiB:.1f} GiB"
    raise RptError(f"no layout of pp {p.pp!r} x fsdp {p.fsdp!r} fits {device_memory / GiB:.1f} GiB per rank on "
                   f"{world_size} ranks (the most divided one still needs {need} on its busiest rank)",
                   "use more ranks, parallel.fsdp = 'auto' or a larger one, a smaller model, fewer micro-batches in "
                   "flight (train.batch_size), model.activation_checkpointing, or a larger device")


def device_memory_bytes(device: torch.device, local_world: int = 1) -> int:
    """What one rank may use: the GPU's memory, or this host's RAM shared among its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // max(1, local_world)


def format_plan(plan: Plan) -> str:
    gib = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    cost_head, scale = ("GFLOP/tok", 1e-9) if plan.cost_unit == "FLOP" else ("us/tok", 1e6)
    data = f"dp {plan.replicas} x fsdp {plan.fsdp}" if plan.fsdp > 1 else f"dp {plan.dp}"
    data = f"cp {plan.cp} x {data}" if plan.cp > 1 else data
    lines = [f"world size {plan.world_size}: pp {plan.pp} x {data}, {plan.microbatches} micro-batches, "
             f"{plan.schedule}; {plan.params:,} parameters; bubble (theory) {plan.bubble_theory:.1%}",
             f"{'stage':>5} {'rank':>4} {'blocks':>9} {'params':>15} {cost_head:>10} {'weights':>9} {'grads':>9} "
             f"{'optim':>9} {'gathered':>9} {'activ.':>9} {'total GiB':>10}"]
    for s in plan.stages:
        mem = s.memory
        blocks = f"{s.blocks[0]}-{s.blocks[1] - 1}"
        lines.append(f"{s.index:>5} {s.index % plan.pp:>4} {blocks:>9} {s.params:>15,} {s.cost * scale:>10.3f} "
                     + " ".join(f"{gib(mem[key]):>9}" for key in ("weights", "grads", "optimizer", "gathered",
                                                                   "activations"))
                     + f" {gib(mem['total']):>10}")
    lines.append(f"peak per rank (its stages together) {gib(plan.peak_memory)} GiB of {gib(plan.device_memory)} GiB: "
                 + ("fits" if plan.fits else "DOES NOT FIT (90% rule)"))
    grads = ", ".join(f"{mode} {b / 2**20:,.1f} MiB" for mode, b in plan.grad_bytes_per_step.items())
    if plan.fsdp_bytes_per_step:
        grads += " (" + ", ".join(f"{kind.replace('_', ' ')} {b / 2**20:,.1f}"
                                  for kind, b in plan.fsdp_bytes_per_step.items()) + ")"
    over = ("FSDP's all-gathers, reduce-scatters and replica all-reduce" if plan.fsdp > 1
            else "every rank (cp x dp)" if plan.cp > 1 else "dp")
    lines.append(f"gradient bytes sent per step by the busiest rank over {over}: {grads}")
    if plan.cp > 1:
        lines.append(f"context states + gradients sent per step by a middle rank of a cp group: "
                     f"{plan.context_bytes_per_step / 2**20:,.2f} MiB")
    if plan.pp > 1:
        lines.append(f"pipeline activations + gradients sent per step by a middle stage: "
                     f"{plan.pipeline_bytes_per_step / 2**20:,.1f} MiB")
    return "\n".join(lines)
