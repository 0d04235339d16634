"""Layer pipeline parallelism: torch.distributed.pipelining, with the recurrent state carried per micro-batch.

The ranks form a 2-D mesh `pp x dp` (DeviceMesh; pipeline outermost as torchtitan lays it out, so the
heavier data-parallel all-reduce runs among neighbouring ranks). Each rank holds one `Stage`: the
blocks the plan (rpt/parallel/plan.py) cut for it from the `RecurrentLM`, the embedding on the
first rank, the final norm and head on the last; it allocates those parts alone (the rest of the
model stays on the meta device), with the values the whole model would have given them. Its blocks form one `Chunk` (a stage of the
schedule), or `v` chunks under the interleaved schedule, where rank r runs stages r, r + pp, ... Parameter names stay those of
the whole model (`blocks.7.cell.weight`), so checkpoints move between pipeline degrees and `rpt eval`
and `rpt generate` read a pipelined run's checkpoint like any other.

Training steps go through torch's GPipe, 1F1B or interleaved 1F1B schedule. What pipelining does not
know about is the recurrent state: each rank keeps its blocks' state for the whole batch, and micro-batch
k reads and writes rows [k b, (k+1) b) of it. Every schedule runs a stage's forwards in micro-batch order,
so each chunk counts its forward calls to know which rows it has (and the count is checked after the step).
The state is detached between steps, as without a pipeline, so losses equal the unpipelined model's.

Tied embeddings: the last stage holds its own copy of the embedding matrix as the head, and after
backward the two copies' gradients are summed between the first and last stage (as Megatron does),
so both take identical AdamW steps. The global gradient norm adds every stage's share once.

Evaluation does not need backward; it sends the activations stage to stage with plain
point-to-point calls, whole batch at a time (`PipelineEval`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rpt.comm.sync import clip_global_norm
from rpt.errors import RptError
from rpt.models.lm import run_blocks
from rpt.models.state import cat_rows, detach_state, rows
from rpt.parallel.plan import Plan


class Mesh:
    """This rank's place in the `pp x dp` layout and the process groups along each dimension."""

    def __init__(self, device: torch.device, world_size: int, pp: int):
        from torch.distributed.device_mesh import init_device_mesh

        self.pp, self.dp = pp, world_size // pp
        self.mesh = init_device_mesh(device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        self.pp_group, self.dp_group = self.mesh.get_group("pp"), self.mesh.get_group("dp")
        self.pp_rank, self.dp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        layout = self.mesh.mesh.tolist()  # [pp][dp] -> global rank
        self.tie_group = None
        for j in range(self.dp):  # every rank creates every group, in the same order
            ends = sorted({layout[0][j], layout[-1][j]})
            group = dist.new_group(ends) if len(ends) > 1 else None
            if j == self.dp_rank and self.pp_rank in (0, pp - 1):
                self.tie_group = group


class _BackwardClock(torch.autograd.Function):
    """Identity whose backward notes when the stage's backward starts (it is the first node reached: the loss,
    or the stage's output) and, through a callback the autograd engine runs when that backward pass has
    finished, when it ends: weight gradients computed after the input gradient included."""

    @staticmethod
    def forward(ctx, x, marks: list):
        ctx.marks = marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        marks = ctx.marks
        began = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: marks.append(time.perf_counter() - began))
        return grad, None


class Stage(nn.Module):
    """What one pipeline rank holds: its blocks (one contiguous run, or one per virtual stage under the
    interleaved schedule), the embedding on rank 0, the final norm and head on the last rank, and the
    recurrent state of its blocks for the whole batch. Parameter names are the whole model's."""

    def __init__(self, model, pp_rank: int, pp: int, chunks: list[tuple[int, tuple[int, int]]], n_stages: int,
                 batch_size: int, microbatches: int):
        super().__init__()
        self.index, self.first, self.last = pp_rank, pp_rank == 0, pp_rank == pp - 1
        self.cfg = model.cfg
        self.embed = model.embed if self.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for _, (a, b) in chunks for i in range(a, b)})
        self.layers = [int(k) for k in self.blocks]  # ascending: the order of the state list
        self.norm = model.norm if self.last else None
        self.head = None
        if self.last:
            self.head = model.head
            if self.cfg.tie_embeddings and not self.first:  # its own copy of the (identically seeded) embedding
                self.head.weight = nn.Parameter(model.embed.weight.detach().clone())
        self.batch_size, self.micro = batch_size, batch_size // microbatches
        self.state: list | None = None  # the whole batch's state of these blocks: the trainer hands it in each step
        self.compute_seconds, self.marks = 0.0, []  # forward + backward seconds of this step; backward durations
        self.chunks = [Chunk(self, j, blocks, n_stages) for j, blocks in chunks]  # a list: not submodules

    def init_state(self, batch: int, device=None) -> list:
        return [b.init_state(batch, device) for b in self.blocks.values()]

    def chunk_state(self, chunk: "Chunk", state: list) -> list:
        return state[chunk.offset:chunk.offset + len(chunk.blocks)]

    def forward(self, x, reset=None):
        """One micro-batch inside a schedule of one stage per rank (the module DDP wraps)."""
        return self.chunks[0](x, reset)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: timed, and its backward marks the stage's start."""
        began = time.perf_counter()
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.compute_seconds += time.perf_counter() - began
        return _BackwardClock.apply(loss, self.marks)

    def begin_step(self) -> None:
        self.marks, self.compute_seconds = [], 0.0
        for c in self.chunks:
            c.calls, c.new = 0, []

    def end_step(self) -> None:
        for c in self.chunks:
            if c.calls * self.micro != self.batch_size:
                raise RuntimeError(f"pipeline stage {c.index} ran {c.calls} micro-batch forwards, expected "
                                   f"{self.batch_size // self.micro}")
        self.state = [s for c in self.chunks for s in cat_rows(c.new)]
        self.compute_seconds += sum(self.marks)  # the backward durations


class Chunk(nn.Module):
    """One stage of the schedule: a contiguous run of the rank's blocks (with the embedding when it is the
    pipeline's first stage, the head when it is the last). Its forwards come in micro-batch order under
    every schedule, so it counts them to know which rows of the carried state are its micro-batch's."""

    def __init__(self, owner: Stage, index: int, blocks: tuple[int, int], n_stages: int):
        super().__init__()
        self.__dict__["owner"] = owner  # not a submodule: the owner holds the parameters
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.embed = owner.embed if self.first else None
        self.blocks = nn.ModuleDict({str(i): owner.blocks[str(i)] for i in range(*blocks)})
        self.offset = owner.layers.index(blocks[0])
        self.norm, self.head = (owner.norm, owner.head) if self.last else (None, None)
        self.calls, self.new = 0, []
        self.probe_input: torch.Tensor | None = None  # the gate-saturation probe's inputs (see forward)

    def run(self, x, state=None, reset=None):
        """x: tokens on the first stage, activations otherwise; returns activations, or logits on the last."""
        if self.embed is not None:
            x = self.embed(x)
        state = state if state is not None else [b.init_state(x.shape[0], x.device) for b in self.blocks.values()]
        x, new = run_blocks(self.blocks.values(), x, state, reset)
        if self.head is not None:
            x = self.head(self.norm(x)).float()
        return x, new

    def step(self, x_t, state):
        """One token through these blocks' single-step forms (the gate-saturation probe): tokens on the first
        stage, activations otherwise; returns activations and the new state."""
        x = self.embed(x_t) if self.embed is not None else x_t
        new = []
        for block, s in zip(self.blocks.values(), state):
            x, s = block(x, s, step=True)
            new.append(s)
        return x, new

    def forward(self, x, reset=None):
        """One micro-batch inside a schedule: rows of the carried state by the order of the calls."""
        owner = self.owner
        began = time.perf_counter()
        k = self.calls
        self.calls += 1
        if k == 0:  # the probe's inputs: the first row's first tokens (activations, on a later stage)
            self.probe_input = x[:1, :8].detach().clone()
        part = slice(k * owner.micro, (k + 1) * owner.micro)
        y, s = self.run(x, rows(owner.chunk_state(self, owner.state), part), reset)
        self.new.append(detach_state(s))
        owner.compute_seconds += time.perf_counter() - began
        return y if self.last else _BackwardClock.apply(y, owner.marks)  # on the last stage the loss has the clock


class Pipeline:
    """One rank's stage and its schedule; the trainer calls `step` in place of forward + backward."""

    def __init__(self, model, plan: Plan, mesh: Mesh, batch_size: int, seq_len: int, device: torch.device,
                 schedule: str):
        self.mesh, self.plan, self.device = mesh, plan, device
        r = mesh.pp_rank
        mine = [(st.index, st.blocks) for st in plan.rank_stages(r)]
        self.stage = Stage(model, r, plan.pp, mine, len(plan.stages), batch_size, plan.microbatches).to(device)
        self.module: nn.Module = self.stage  # replaced by the data-parallel wrapper (DDP) when dp > 1
        self.batch_size, self.seq_len, self.schedule_name = batch_size, seq_len, schedule
        self.schedule = None
        self.history: list[tuple[float, float]] = []  # (this stage's compute seconds, step seconds) per step
        self._bubble_taken = 0

    def wrap(self, module: nn.Module | list[nn.Module]) -> None:
        """Build the schedule around the stage, or around each of the rank's virtual stages under the interleaved
        schedule: as they are, or as the data-parallel wrapper made them (DDP of the stage, or a list with one
        DDP per virtual stage). Call once, after data parallelism."""
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        self.module = module
        mb, T, D, V = self.stage.micro, self.seq_len, self.stage.cfg.d_model, self.stage.cfg.vocab_size

        def pipe_stage(submodule, chunk: Chunk):
            # static shapes (no trial forward): activations and logits carry gradients, tokens do not
            x = torch.zeros(mb, T, dtype=torch.long) if chunk.first else torch.zeros(mb, T, D, requires_grad=True)
            y = torch.zeros(mb, T, V if chunk.last else D, requires_grad=True)
            return PipelineStage(submodule, chunk.index, len(self.plan.stages), self.device,
                                 input_args=x.to(self.device), output_args=y.to(self.device), group=self.mesh.pp_group)

        m, loss = self.plan.microbatches, self.stage.loss
        if self.schedule_name == "interleaved":
            chunks = self.stage.chunks
            modules = module if isinstance(module, list) else chunks
            self.schedule = ScheduleInterleaved1F1B([pipe_stage(s, c) for s, c in zip(modules, chunks)], m,
                                                    loss_fn=loss)
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
            self.schedule = cls(pipe_stage(module, self.stage.chunks[0]), m, loss_fn=loss)

    def step(self, x: torch.Tensor, y: torch.Tensor, reset: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of the whole batch through the pipeline; returns the mean loss on every stage."""
        began = time.perf_counter()
        self.stage.begin_step()
        kwargs = {} if reset is None else {"reset": reset}
        losses: list[torch.Tensor] = []
        args = (x,) if self.stage.first else ()
        self.schedule.step(*args, target=y if self.stage.last else None, losses=losses, **kwargs)
        self.stage.end_step()
        self._sync_tied_gradients()
        wall = time.perf_counter() - began
        self.history.append((self.stage.compute_seconds, wall))
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.mesh.pp_group, group_src=self.plan.pp - 1)
        return loss

    def _sync_tied_gradients(self) -> None:
        st = self.stage
        if not st.cfg.tie_embeddings or self.mesh.tie_group is None:
            return
        weight = st.embed.weight if st.first else st.head.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self.mesh.tie_group)

    def counted_params(self) -> list[nn.Parameter]:
        """This stage's parameters for the global norm, the tied head copy left out (the embedding counts it)."""
        st = self.stage
        skip = {id(st.head.weight)} if st.last and not st.first and st.cfg.tie_embeddings else set()
        return [p for p in st.parameters() if id(p) not in skip]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient (every stage's share added once), clipped on every stage."""
        return clip_global_norm(self.counted_params(), max_norm, device=self.device, reduce=True,
                                group=self.mesh.pp_group, scale=list(self.stage.parameters()))

    def take_bubble(self) -> float | None:
        """Mean idle share of this stage over the steps since the last call."""
        h, self._bubble_taken = self.history[self._bubble_taken:], len(self.history)
        return max(0.0, 1.0 - sum(c for c, _ in h) / sum(w for _, w in h)) if h else None


class PipelineEval(nn.Module):
    """`model(x, state, reset) -> (logits, state)` across the stages, forward only: what evaluate() calls.
    Logits exist on the last rank; the other ranks return None for them."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.pipe = pipeline
        self.stage = pipeline.stage

    def forward(self, x, state=None, reset=None):
        st, mesh = self.stage, self.pipe.mesh
        state = state if state is not None else st.init_state(x.shape[0], x.device)
        new, out = [], None
        for chunk in st.chunks:  # in stage order; stage j runs on pipeline rank j % pp
            h = x
            if not chunk.first:
                h = torch.empty(x.shape[0], x.shape[1], st.cfg.d_model, device=x.device)
                dist.recv(h, group=mesh.pp_group, group_src=(chunk.index - 1) % mesh.pp)
            out, s = chunk.run(h, st.chunk_state(chunk, state), reset)
            new.extend(s)
            if not chunk.last:
                dist.send(out.float().contiguous(), group=mesh.pp_group, group_dst=(chunk.index + 1) % mesh.pp)
        return (out if st.last else None), new


def check_layout(cfg, world_size: int) -> None:
    """Refuse, before anything is built or written, a pipeline degree the ranks cannot form."""
    pp = cfg.parallel.pp
    if pp != "auto" and world_size % int(pp):
        raise RptError(f"world size {world_size} is not divisible by parallel.pp = {pp}",
                       f"run a multiple of {pp} ranks (e.g. --nproc {pp * max(1, world_size // int(pp))}), "
                       "or choose a parallel.pp that divides the world size")


def setup(cfg, rank: int, world_size: int, device: torch.device, local_world: int = 1,
          seed: int = 0) -> Pipeline | None:
    """The plan for this job (printed by rank 0), and this rank's pipeline when it has more than one stage.
    The rank allocates the parts of the model its stages hold, and nothing else: with `seed` their initial
    values are the ones `torch.manual_seed(seed); RecurrentLM(cfg.model)` gives the whole model."""
    from rpt.models import RecurrentLM
    from rpt.parallel.plan import choose_plan, device_memory_bytes, format_plan

    if cfg.parallel.pp == 1:
        return None
    costs = measure_costs(cfg, device)
    plan = choose_plan(cfg, world_size, device_memory_bytes(device, local_world), costs)
    if rank == 0:
        print(format_plan(plan), flush=True)
    if plan.pp == 1:
        return None
    mesh = Mesh(device, world_size, plan.pp)
    torch.manual_seed(seed)
    model = RecurrentLM(cfg.model, build=parts_of(plan, mesh.pp_rank, cfg.model.tie_embeddings).__contains__)
    return Pipeline(model, plan, mesh, cfg.train.batch_size, cfg.train.seq_len, device, cfg.parallel.schedule)


def parts_of(plan: Plan, pp_rank: int, tied: bool) -> set[str]:
    """Names of the model parts pipeline rank `pp_rank` holds: its blocks, the embedding on the first rank, the
    final norm and head on the last (and the embedding there too when tied: the head starts as its copy)."""
    parts = {f"blocks.{i}" for st in plan.rank_stages(pp_rank) for i in range(*st.blocks)}
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    if first or (last and tied):
        parts.add("embed")
    if last:
        parts |= {"norm", "head"}
    return parts


def measure_costs(cfg, device: torch.device, repeats: int = 3):
    """Seconds per token of forward + backward of each kind of block, the embedding and the output layer with
    its loss, timed on this device at the micro-batch shape (best of `repeats`) on a sample of each, and averaged
    over the ranks, so every rank cuts the same stages. Counted FLOPs miss what dominates small models on a CPU
    (elementwise gate work, the softmax of the loss): balanced by FLOPs, a 2-stage 4-block LSTM ran its last
    stage 25% longer."""
    from rpt.models.block import Block, has_attention, make_norm
    from rpt.parallel.plan import Costs

    m = cfg.model
    B, T, D = cfg.train.batch_size // cfg.parallel.microbatches, cfg.train.seq_len, m.d_model
    tokens = B * T

    def best_time(fn) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            began = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - began)
        return min(times[1:]) / tokens

    with torch.random.fork_rng(devices=[]):  # the samples' values do not matter; the model's seeds stay as they were
        x = torch.randn(B, T, D, device=device, requires_grad=True)
        ids = torch.randint(0, m.vocab_size, (B, T), device=device)
        kinds = {}
        for i in range(m.n_layers):
            kind = has_attention(m, i)
            if kind not in kinds:
                sample = Block(m, i).to(device)
                kinds[kind] = best_time(lambda: sample(x, sample.init_state(B, device), None)[0].sum().backward())
        embed = nn.Embedding(m.vocab_size, D).to(device)
        embed_cost = best_time(lambda: embed(ids).sum().backward())
        norm, head = make_norm(m).to(device), nn.Linear(D, m.vocab_size, bias=False).to(device)
        head_cost = best_time(lambda: F.cross_entropy(head(norm(x)).float().flatten(0, 1), ids.flatten()).backward())
    figures = torch.tensor([kinds.get(False, 0.0), kinds.get(True, 0.0), embed_cost, head_cost],
                           dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(figures)
        figures /= dist.get_world_size()
    plain, attn, embed_cost, head_cost = figures.tolist()
    return Costs({False: plain, True: attn}, embed_cost, head_cost, unit="s")
