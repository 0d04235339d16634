"""Gradient codecs for all-reduce data parallelism, as DDP communication hooks.

DDP hands each bucket (a flat gradient buffer) to the hook as soon as backward has filled it,
so every codec here overlaps backward exactly as DDP's own all-reduce does. Each hook returns
the bucket averaged over ranks and reports the bytes it sent and when to `CommMeter`.

- `none`: all-reduce in fp32 (what DDP does without a hook, plus the accounting).
- `fp16` / `bf16`: all-reduce a half-width copy (as torch's fp16/bf16 hooks do).
- `powersgd`: torch's own PowerSGD hook (rank r, error feedback, warm start), reused as is;
  bytes come from its `total_numel_after_compression` counter, which counts every P, Q and
  uncompressed tensor it all-reduces. Plain all-reduce until `start_iter`, as PowerSGD requires.
  Its hook issues its second and third all-reduce from a completion callback, which gloo runs on
  its own threads; with several buckets, ranks then issue collectives in different orders and
  hang (seen here). On CPU rpt therefore runs the rounds on one worker thread and a process group
  of their own, one bucket after another in bucket order: ranks issue them alike, and backward goes
  on meanwhile (overlap). Over a pipeline's dp group each round is still waited for in the hook
  (a group of its own there would need every rank to create every dp group's). CUDA buckets keep
  the hook's own chaining.
- `topk`: written here because torch ships no sparse codec: each rank keeps the k largest
  entries of (gradient + its error), all-gathers (values, indices), scatters them back into a
  dense average; what it did not send stays in its error buffer for the next step (error feedback).

The hooks carry no return annotation: DDP checks it at registration, and under
`from __future__ import annotations` it would be a string that fails the check.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from rpt.comm.accounting import CommMeter, allgather_wire_bytes, allreduce_wire_bytes

# PowerSGD's callbacks hold their process group and are released on that group's own gloo threads. Were one of
# them to drop the last reference, gloo's destructor would join the thread it runs on and abort the process
# ("Resource deadlock avoided"), which it did at the end of a run. The groups made here live as long as the process.
_ROUND_GROUPS: list = []


@dataclass
class HookState:
    meter: CommMeter
    world_size: int
    group: object = None  # the data-parallel process group (None: every rank)
    topk_fraction: float = 0.01
    powersgd: psgd.PowerSGDState | None = None
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    worker: ThreadPoolExecutor | None = None  # PowerSGD's rounds on the CPU, one bucket after another

    def state_dict(self) -> dict:
        """What carries from step to step on this rank: top-k's error buffers, PowerSGD's state (its error
        feedback, warm-started factors, generator and step count; all of its slots but the process group)."""
        ps = self.powersgd
        return {"errors": self.errors,
                "powersgd": None if ps is None else {k: getattr(ps, k) for k in ps.__slots__ if k != "process_group"}}

    def load_state_dict(self, state: dict) -> None:
        self.errors = state["errors"]
        if self.powersgd is not None and state["powersgd"] is not None:  # a PowerSGD run's, or none at all
            for k, v in state["powersgd"].items():
                setattr(self.powersgd, k, v)


def _finish(state: HookState, bucket, start: float, wire: int):
    def done(fut):
        state.meter.completed(start, bucket.index(), wire)
        return fut.value()[0] if isinstance(fut.value(), list) else fut.value()
    return done


def allreduce_hook(state: HookState, bucket):
    buf = bucket.buffer().div_(state.world_size)
    start = state.meter.launched()
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(_finish(state, bucket, start, allreduce_wire_bytes(buf.nbytes, state.world_size)))


def _half_hook(dtype: torch.dtype):
    def hook(state: HookState, bucket):
        buf = bucket.buffer()
        half = buf.to(dtype).div_(state.world_size)
        start = state.meter.launched()
        fut = dist.all_reduce(half, group=state.group, async_op=True).get_future()
        record = _finish(state, bucket, start, allreduce_wire_bytes(half.nbytes, state.world_size))

        def back(f):
            return buf.copy_(record(f))
        return fut.then(back)
    return hook


def powersgd_hook(state: HookState, bucket):
    if state.worker is None:
        fut = _powersgd_round(state, bucket)  # on the GPU, torch's own chaining
        if not bucket.buffer().is_cuda:  # a pipeline's dp group on gloo: each round waited for (module docstring)
            waited = time.perf_counter()
            fut.wait()
            state.meter.add_exposed(time.perf_counter() - waited)
        return fut
    # gloo: see the module docstring. One bucket's round at a time, in bucket order (the same on every rank), on
    # a worker thread and a process group of its own, so that backward goes on meanwhile.
    done = torch.futures.Future()
    state.meter.launched()  # the exposed wait counts from the last bucket handed over, however long it queues

    def run():
        try:
            done.set_result(_powersgd_round(state, bucket, time.perf_counter()).wait())
        except BaseException as e:  # noqa: BLE001 (DDP raises it where it waits for the bucket)
            done.set_exception(e)
    state.worker.submit(run)
    return done


def _powersgd_round(state: HookState, bucket, start: float | None = None):
    ps = state.powersgd
    vanilla = ps.iter < ps.start_powerSGD_iter
    before = ps.total_numel_after_compression
    start = state.meter.launched() if start is None else start
    fut = psgd.powerSGD_hook(ps, bucket)
    numel = bucket.buffer().numel() if vanilla else ps.total_numel_after_compression - before
    wire = allreduce_wire_bytes(numel * bucket.buffer().element_size(), state.world_size)
    return fut.then(_finish(state, bucket, start, wire))


def topk_hook(state: HookState, bucket):
    buf, index, p = bucket.buffer(), bucket.index(), state.world_size
    error = state.errors.get(index)
    # the layout is fixed for top-k (AllReduceSync); a buffer of another shape would be another model's
    acc = buf + error if error is not None and error.shape == buf.shape else buf.clone()
    k = max(1, int(state.topk_fraction * acc.numel()))
    chosen = acc.abs().topk(k, sorted=False).indices
    values = acc[chosen]
    acc[chosen] = 0.0
    state.errors[index] = acc  # what was not sent waits for the next step
    # values and indices travel together: int32 indices reinterpreted as float32 bits
    packed = torch.cat([values.float(), chosen.to(torch.int32).view(torch.float32)])
    gathered = [torch.empty_like(packed) for _ in range(p)]
    start = state.meter.launched()
    fut = dist.all_gather(gathered, packed, group=state.group, async_op=True).get_future()
    record = _finish(state, bucket, start, allgather_wire_bytes(packed.nbytes, p))

    def decode(f):
        record(f)
        dense = torch.zeros_like(buf, dtype=torch.float32)
        for part in gathered:
            dense.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
        return buf.copy_(dense.div_(p))
    return fut.then(decode)


def register(ddp: torch.nn.parallel.DistributedDataParallel, compression: str, meter: CommMeter, *,
             world_size: int, powersgd_rank: int = 4, powersgd_start: int = 2, topk_fraction: float = 0.01,
             seed: int = 0, group=None) -> HookState:
    state = HookState(meter=meter, world_size=world_size, group=group, topk_fraction=topk_fraction)
    if compression == "powersgd":
        rounds = group
        if group is None and not next(ddp.module.parameters()).is_cuda:
            # the rounds' collectives get a process group of their own: on the main thread DDP all-reduces its
            # unused-parameter map meanwhile, and two threads on one gloo group interleave differently per rank
            rounds = dist.new_group(backend="gloo")
            _ROUND_GROUPS.append(rounds)
            state.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rpt-powersgd")
        state.powersgd = psgd.PowerSGDState(process_group=rounds, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=max(2, powersgd_start), use_error_feedback=True,
                                            warm_start=True, random_seed=seed)
    hook = {"none": allreduce_hook, "fp16": _half_hook(torch.float16), "bf16": _half_hook(torch.bfloat16),
            "powersgd": powersgd_hook, "topk": topk_hook}[compression]
    ddp.register_comm_hook(state, hook)
    return state
