"""Layer pipeline parallelism: torch.distributed.pipelining, with the recurrent state carried per micro-batch.

The ranks form a mesh `pp x dp x fsdp` (rpt/parallel/mesh.py). Each rank builds the `RecurrentLM` with the
parts the plan (rpt/parallel/plan.py) gives it: its blocks, the embedding on the first rank, the final norm and
head on the last; the model's own forward runs them, and a part it builds has the values the whole model would
have given it. Each stage of the schedule is a view of that model (one per rank, or `v` under the interleaved
schedule, where rank r runs stages r, r + pp, ...). Parameter names stay those of the whole model
(`blocks.7.cell.w_ih`), so checkpoints move between pipeline degrees and `rpt eval` and `rpt generate` read a
pipelined run's checkpoint like any other.

Training steps go through torch's GPipe, 1F1B or interleaved 1F1B schedule. What pipelining does not
know about is the recurrent state: each rank keeps its blocks' state for the whole batch, and micro-batch
k reads and writes rows [k b, (k+1) b) of it. Every schedule runs a stage's forwards in micro-batch order,
so each stage counts its forward calls to know which rows it has (and the count is checked after the step).
The state is detached between steps, as without a pipeline, so losses equal the unpipelined model's.

Tied embeddings: the last stage holds its own copy of the embedding matrix as the head, and after
backward the two copies' gradients are summed between the first and last stage (as Megatron does),
so both take identical AdamW steps. The global gradient norm adds every stage's share once.

Evaluation does not need backward; it sends the activations stage to stage with plain
point-to-point calls, whole batch at a time (`PipelineEval`).
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from rpt.comm.gradient_sync import clip_global_norm
from rpt.models.heads import next_token_loss
from rpt.models.state import cat_rows, detach_state, rows
from rpt.parallel.fsdp import LocalGrad, gathered, local
from rpt.parallel.mesh import Mesh
from rpt.parallel.plan import Plan


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


class MicroBatchStage(nn.Module):
    """One stage of the schedule: its `RecurrentLM` (a view of the rank's model holding that stage's parts), called
    once per micro-batch. Every schedule runs a stage's forwards in micro-batch order, so the count of calls says
    which rows of the carried state a call has; the new rows are kept for the next step and the work is timed."""

    def __init__(self, lm, index: int, n_stages: int, pipe: "Pipeline"):
        super().__init__()
        self.lm = lm
        self.__dict__["pipe"] = pipe  # not a submodule
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.length = len(lm.state_layers())  # its entries of the rank's state (a loop's core once per slot)
        self.offset = 0  # where they start: the Pipeline sets it
        self.calls, self.new = 0, []

    def state_of(self, state: list) -> list:
        return state[self.offset:self.offset + self.length]

    def forward(self, x, reset=None, targets=None):
        """The last stage returns each token's loss in nats (the model's own: a two-level head's too), the others
        their activations."""
        pipe = self.pipe
        began = time.perf_counter()
        k, self.calls = self.calls, self.calls + 1
        y, s = self.lm(x, rows(self.state_of(pipe.state), slice(k * pipe.micro, (k + 1) * pipe.micro)), reset,
                       targets if self.last else None, pipe.depth)
        self.new.append(detach_state(s))
        pipe.compute_seconds += time.perf_counter() - began
        return y if self.last else _BackwardClock.apply(y, pipe.marks)  # on the last stage the loss has the clock


def stage_parts(stage, plan: Plan) -> set[str]:
    """The model parts of one stage of the schedule: its blocks, the embedding on the first, norm and head on the
    last, a looped model's loop (its adapter and norms) where its core is."""
    parts = {f"blocks.{i}" for i in range(*stage.blocks)}
    parts |= {"embed"} if stage.index == 0 else set()
    core = plan.loop_blocks[0]
    parts |= {"loop"} if plan.loop_blocks[1] and stage.blocks[0] <= core < stage.blocks[1] else set()
    return parts | ({"norm", "head"} if stage.index == len(plan.stages) - 1 else set())


def parts_of(plan: Plan, pp_rank: int) -> set[str]:
    """The model parts pipeline rank `pp_rank` holds: those of its stages."""
    return set().union(*(stage_parts(st, plan) for st in plan.rank_stages(pp_rank)))


class Pipeline:
    """One rank's stages of the schedule over its `RecurrentLM` (built with the parts it owns) and the recurrent
    state of its blocks for the whole batch; the trainer calls `step` in place of forward + backward."""

    def __init__(self, model, plan: Plan, mesh: Mesh, batch_size: int, seq_len: int, device: torch.device,
                 schedule: str):
        self.model, self.mesh, self.plan, self.device = model, mesh, plan, device
        self.index = r = mesh.pp_rank
        self.first, self.last = r == 0, r == plan.pp - 1
        self.batch_size, self.micro, self.seq_len = batch_size, batch_size // plan.microbatches, seq_len
        self.state: list | None = None  # the whole batch's state of these blocks: the trainer hands it in each step
        self.depth: int | None = None  # a looped model's depth this step (every stage, every micro-batch)
        self.compute_seconds, self.marks = 0.0, []  # forward + backward seconds of this step; backward durations
        n = len(plan.stages)
        self.stages = [MicroBatchStage(model.view(stage_parts(st, plan)), st.index, n, self) for st in plan.rank_stages(r)]
        self.layers = []  # the block of each entry of the state list: the stages' entries, in stage order
        for st in self.stages:
            st.offset = len(self.layers)
            self.layers += st.lm.state_layers()
        self.schedule_name, self.schedule = schedule, None
        self.history: list[tuple[float, float]] = []  # (this stage's compute seconds, step seconds) per step

    def build_schedule(self, modules: list[nn.Module]) -> None:
        """The schedule around this rank's stages, as they are or as data parallelism wrapped them (one DDP
        each). Call once, after data parallelism."""
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        mb, T, D = self.micro, self.seq_len, self.model.cfg.d_model

        def pipe_stage(module, stage: MicroBatchStage):
            # static shapes (no trial forward): activations and losses carry gradients, tokens do not
            x = torch.zeros(mb, T, dtype=torch.long) if stage.first else torch.zeros(mb, T, D, requires_grad=True)
            y = torch.zeros(mb, T, requires_grad=True) if stage.last else torch.zeros(mb, T, D, requires_grad=True)
            return PipelineStage(module, stage.index, len(self.plan.stages), self.device,
                                 input_args=x.to(self.device), output_args=y.to(self.device), group=self.mesh.pp_group)

        m, stages = self.plan.microbatches, [pipe_stage(mod, st) for mod, st in zip(modules, self.stages)]
        if self.schedule_name == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=self.loss)
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
            self.schedule = cls(stages[0], m, loss_fn=self.loss)

    def loss(self, nats: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the mean of the stage's nats (its targets came in with
        the inputs); its backward marks the stage's start."""
        return _BackwardClock.apply(nats.mean(), self.marks)

    def step(self, x: torch.Tensor, y: torch.Tensor, reset: torch.Tensor | None,
             depth: int | None = None) -> torch.Tensor:
        """Forward and backward of the whole batch through the pipeline (a looped model at `depth`); returns the
        mean loss on every stage."""
        began = time.perf_counter()
        self.marks, self.compute_seconds, self.depth = [], 0.0, depth
        for st in self.stages:
            st.calls, st.new = 0, []
        kwargs = {"targets": y} if reset is None else {"reset": reset, "targets": y}
        losses: list[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None, losses=losses, **kwargs)
        for st in self.stages:
            if st.calls * self.micro != self.batch_size:
                raise RuntimeError(f"pipeline stage {st.index} ran {st.calls} micro-batch forwards, expected "
                                   f"{self.batch_size // self.micro}")
        self.state = [s for st in self.stages for s in cat_rows(st.new)]
        self.compute_seconds += sum(self.marks)  # the backward durations
        self._sync_tied_gradients()
        self.history.append((self.compute_seconds, time.perf_counter() - began))
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.mesh.pp_group, group_src=self.plan.pp - 1)
        return loss

    def _sync_tied_gradients(self) -> None:
        if not self.model.cfg.tie_embeddings or self.mesh.tie_group is None:
            return
        weight = self.model.embed.weight if self.first else self.model.head.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(local(weight.grad), group=self.mesh.tie_group)  # under FSDP both ends hold one shard

    def counted_params(self) -> list[nn.Parameter]:
        """This stage's parameters for the global norm, the tied head copy left out (the embedding counts it)."""
        m = self.model
        skip = {id(m.head.weight)} if self.last and not self.first and m.cfg.tie_embeddings else set()
        return [p for p in m.parameters() if id(p) not in skip]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient (every stage's share added once), clipped on every stage."""
        counted, scale, groups = self.counted_params(), list(self.model.parameters()), (self.mesh.pp_group,)
        if self.mesh.fsdp > 1:  # each rank's shards, added over the shard group too
            counted, scale = [LocalGrad(p) for p in counted], [LocalGrad(p) for p in scale]
            groups = (self.mesh.shard_group, self.mesh.pp_group)
        return clip_global_norm(counted, max_norm, device=self.device, reduce=True, group=groups, scale=scale)


class PipelineEval(nn.Module):
    """`model(x, state, reset, targets) -> (nats, state)` across the stages, forward only: what evaluate()
    calls. The losses exist on the last rank; the other ranks return None for them."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.__dict__["pipe"] = pipeline
        self.model = pipeline.model
        self.cfg = self.model.cfg

    @property
    def loop(self):
        """A looped model's loop, where this rank holds its core (what a validation watches)."""
        return self.model.loop

    def forward(self, x, state=None, reset=None, targets=None, depth=None):
        """`state`: each stage's, in a list (a looped model's grows with a depth beyond its slots)."""
        pipe, mesh = self.pipe, self.pipe.mesh
        state = state if state is not None else [st.lm.init_state(x.shape[0], x.device) for st in pipe.stages]
        new, out = [], None
        for st in pipe.stages:  # in stage order; stage j runs on pipeline rank j % pp
            h = x
            if not st.first:
                h = torch.empty(x.shape[0], x.shape[1], self.model.cfg.d_model, device=x.device)
                dist.recv(h, group=mesh.pp_group, group_src=(st.index - 1) % mesh.pp)
            with gathered(st):  # FSDP: the stage's own parameters (embedding, head), unsharded
                out, s = st.lm(h, state[len(new)], reset, targets if st.last else None, depth)
            new.append(s)
            if not st.last:
                dist.send(out.float().contiguous(), group=mesh.pp_group, group_dst=(st.index + 1) % mesh.pp)
        if not pipe.last:
            return None, new
        return out, new


def measure_costs(m, micro_batch: int, seq_len: int, device: torch.device, repeats: int = 3):
    """Seconds per token of forward + backward of each kind of block of the model section `m`, the embedding and
    the output layer with its loss, timed on this device at the micro-batch shape (`micro_batch` rows of `seq_len`
    tokens; best of `repeats`) on a sample of each, and averaged over the ranks, so every rank cuts the same
    stages. Counted FLOPs miss what dominates small models on a CPU (elementwise gate work, the softmax of the
    loss): balanced by FLOPs, a 2-stage 4-block LSTM ran its last stage 25% longer."""
    from rpt.models.lm import Block, has_attention, make_norm
    from rpt.parallel.plan import Costs

    B, T, D = micro_batch, seq_len, m.d_model
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
                run = partial(checkpoint, sample, use_reentrant=False) if m.activation_checkpointing else sample
                kinds[kind] = best_time(lambda: run(x, sample.init_state(B, device), None)[0].sum().backward())
        embed = nn.Embedding(m.vocab_size, D).to(device)
        embed_cost = best_time(lambda: embed(ids).sum().backward())
        norm, head = make_norm(m).to(device), nn.Linear(D, m.vocab_size, bias=False).to(device)
        head_cost = best_time(lambda: next_token_loss(head(norm(x)), ids).backward())
    figures = torch.tensor([kinds.get(False, 0.0), kinds.get(True, 0.0), embed_cost, head_cost],
                           dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(figures)
        figures /= dist.get_world_size()
    plain, attn, embed_cost, head_cost = figures.tolist()
    return Costs({False: plain, True: attn}, embed_cost, head_cost, unit="s")
