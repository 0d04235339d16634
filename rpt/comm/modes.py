"""Gradient synchronisation across data-parallel ranks: the modes of `comm.mode`.

The trainer drives every mode through the same five calls, in this order each step:

    with sync.no_sync():  ... backward of the inner micro-steps (gradient accumulation)
    backward of the last micro-step             (transfers start as buckets fill: overlap)
    sync.wait_gradients()                        the owners now hold the averaged gradients
    sync.clip_grad_norm(max_norm)                one global norm, the same on every rank
    optimizer step on `sync.owned` parameters    (AdamW only where a rank owns parameters)
    sync.share_parameters()                      owners send the updated parameters back

- `AllReduceSync`: torch DDP with its buckets, plus the codec hooks of compress.py, or the
  adaptive schedule of adaptive.py (important groups every step, minor ones every N steps).
- `ParameterServerSync` (`ps`, `ps-sharded`): written here because DDP cannot express it. DDP
  always all-reduces each bucket into every replica and rebuilds its buckets after the first
  step, while a parameter server needs fixed ownership: the owner of a bucket alone receives
  its gradients, holds its optimiser state, steps it and sends the parameters back. Buckets are
  cut here once, in reverse parameter order (about the order backward produces gradients), and a
  bucket's transfer starts from a post-accumulate-grad hook the moment its last gradient is ready.
  Transfers are point-to-point sends, so the traffic really converges on the owner (`ps`: rank 0
  owns everything; `ps-sharded`: buckets go to the least-loaded rank, largest first, which
  partitions the optimiser state as ZeRO-1 does). `comm.compression` fp16/bf16 sends the
  gradients at half width; parameters always travel in full precision, so replicas stay identical.
- `DiLoCoSync` (`diloco`, rpt/comm/diloco.py): local steps, and every H steps an outer step on the averaged
  change of the parameters.
- `auto` (`choose_mode`): the links are measured and each mode's traffic pattern timed at start
  (rpt/comm/links.py); every rank gets the same numbers and takes the same mode.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rpt.comm import compress
from rpt.comm.adaptive import AdaptiveSchedule
from rpt.comm.diloco import DiLoCoSync
from rpt.comm.gradient_sync import GradientSync, clip_global_norm
from rpt.config import CommConfig
from rpt.comm import links

log = logging.getLogger("rpt.comm")


class AllReduceSync(GradientSync):
    """DDP over the model, or over each of `parts` (disjoint pieces of it that run their forward and backward
    separately: the virtual stages of an interleaved pipeline, which torch's schedule hands DDP one by one).
    Parts share the meter and the adaptive schedule; each has its own DDP buckets and codec state.

    PowerSGD, top-k and the adaptive schedule keep per-rank state from step to step; a checkpoint saves it and
    a resume restores it. The codecs' state is indexed by DDP bucket (torch's PowerSGD hook does so itself),
    and DDP cuts its buckets anew, by the order gradients became ready, after the first backward of every
    process, so a resumed run's first step would meet that state in another layout (and lose exactness from
    there). With those codecs each DDP therefore runs one backward of a one-token input before its codec is
    registered (`settle_buckets`): every process, new or resumed, then trains in the re-cut layout from its
    first step. The adaptive schedule keys its state by parameter and needs no such thing."""

    def __init__(self, model: torch.nn.Module, cfg: CommConfig, world_size: int, *, powersgd_start: int, seed: int,
                 group=None, parts: list[torch.nn.Module] | None = None, example=None):
        """`example(module)`: an input of `module` for `settle_buckets` (default: one token, or one token's
        activations for a pipeline stage without the embedding)."""
        super().__init__(model)
        wrapped = [DDP(m, bucket_cap_mb=cfg.bucket_mb, process_group=group) for m in (parts or [model])]
        if not cfg.adaptive and cfg.compression in ("powersgd", "topk"):
            for ddp in wrapped:
                settle_buckets(ddp, (example or one_token)(ddp.module))
        self.module = wrapped if parts else wrapped[0]
        self.schedule = AdaptiveSchedule(model, cfg, self.meter, world_size, group) if cfg.adaptive else None
        self.hooks: list[compress.HookState] = []
        self.bucket_mb = cfg.bucket_mb
        for ddp in wrapped:
            if self.schedule is not None:
                ddp.register_comm_hook(None, self.schedule.hook)
            else:
                self.hooks.append(compress.register(ddp, cfg.compression, self.meter, world_size=world_size,
                                                    powersgd_rank=cfg.powersgd_rank, powersgd_start=powersgd_start,
                                                    topk_fraction=cfg.topk_fraction, seed=seed, group=group))
        self._wrapped = wrapped

    def state_dict(self) -> dict:
        return {"hooks": [h.state_dict() for h in self.hooks], "bucket_mb": self.bucket_mb,
                "adaptive": self.schedule.state_dict() if self.schedule is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint written without this state (another mode or codec, or before rpt kept it) leaves the
        codecs to start afresh, as a new run's do; so does one cut into buckets of another size (the codecs'
        buffers follow the layout)."""
        if state.get("hooks") and state.get("bucket_mb") != self.bucket_mb:
            log.warning("the checkpoint's codec state is for comm.bucket_mb = %s, not %s: the codecs start afresh",
                        state.get("bucket_mb"), self.bucket_mb)
        elif len(state.get("hooks", [])) == len(self.hooks):
            for hook, saved in zip(self.hooks, state["hooks"]):
                hook.load_state_dict(saved)
        if self.schedule is not None and state.get("adaptive") is not None:
            self.schedule.load_state_dict(state["adaptive"])

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for ddp in self._wrapped:
                stack.enter_context(ddp.no_sync())
            yield

    def wait_gradients(self) -> None:
        # DDP waited for its buckets inside backward; the wait after the last bucket was launched is exposed.
        if self.meter.last_launch:
            self.meter.add_exposed(time.perf_counter() - self.meter.last_launch)
        if self.schedule is not None:
            self.schedule.after_backward()

    def schedule_in_force(self) -> dict:
        return self.schedule.in_force() if self.schedule is not None else {}


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter], owner: int):
        self.index, self.params, self.owner = index, params, owner
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.works: list = []
        self.received: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.start = 0.0


class ParameterServerSync(GradientSync):
    def __init__(self, model: torch.nn.Module, cfg: CommConfig, rank: int, world_size: int, sharded: bool):
        super().__init__(model)
        self.rank, self.world_size = rank, world_size
        self.device = next(model.parameters()).device
        self.wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.compression)  # gradients only
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets = _assign_owners(_cut(params, int(cfg.bucket_mb * 2**20)), world_size, sharded)
        self.owned = [p for b in self.buckets if b.owner == rank for p in b.params]
        self.enabled = True
        with torch.no_grad():  # every replica starts from rank 0's parameters
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda _p, b=b: self._on_grad(b))

    @contextmanager
    def no_sync(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def _on_grad(self, b: _Bucket) -> None:
        if not self.enabled:
            return
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.ready = -1  # launched
        b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params])
        if self.wire_dtype is not None:
            b.flat = b.flat.to(self.wire_dtype)
        b.start = self.meter.launched()
        if b.owner == self.rank:
            b.received = [torch.empty_like(b.flat) for _ in range(self.world_size - 1)]
            peers = [r for r in range(self.world_size) if r != self.rank]
            b.works = [dist.irecv(buf, src=r, tag=b.index) for buf, r in zip(b.received, peers)]
        else:
            b.works = [dist.isend(b.flat, dst=b.owner, tag=b.index)]

    def wait_gradients(self) -> None:
        waited = time.perf_counter()
        for b in self.buckets:  # a parameter without a gradient this step still has its transfer
            if b.ready != -1:
                self._launch(b)
        for b in self.buckets:
            for w in b.works:
                w.wait()
            sent = 0 if b.owner == self.rank else b.flat.nbytes
            self.meter.completed(b.start, b.index, sent)
            if b.owner == self.rank:
                total = b.flat.float()
                for part in b.received:
                    total += part.float()
                total /= self.world_size
                offset = 0
                for p in b.params:
                    p.grad = total[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
            else:
                for p in b.params:
                    p.grad = None  # workers keep neither these gradients nor optimiser state
            b.works, b.received, b.flat, b.ready = [], [], None, 0
        self.meter.add_exposed(time.perf_counter() - waited)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # every rank adds its owned share (on the parameters' device, a rank owning nothing too)
        return clip_global_norm(self.owned, max_norm, device=self.device, reduce=True)

    def share_parameters(self) -> None:
        waited = time.perf_counter()
        pending = []
        with torch.no_grad():
            for b in self.buckets:
                start = self.meter.launched()
                if b.owner == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in b.params])
                    works = [dist.isend(flat, dst=r, tag=10_000 + b.index) for r in range(self.world_size) if r != self.rank]
                    sent = flat.nbytes * (self.world_size - 1)
                else:
                    flat = torch.empty(b.numel, dtype=b.params[0].dtype, device=self.device)
                    works, sent = [dist.irecv(flat, src=b.owner, tag=10_000 + b.index)], 0
                pending.append((b, flat, works, start, sent))
            for b, flat, works, start, sent in pending:
                for w in works:
                    w.wait()
                self.meter.completed(start, b.index, sent)
                if b.owner != self.rank:
                    offset = 0
                    for p in b.params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
        self.meter.add_exposed(time.perf_counter() - waited)


def _cut(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    buckets, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() * p.element_size() > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    return buckets + ([current] if current else [])


def _assign_owners(groups: list[list[torch.nn.Parameter]], world_size: int, sharded: bool) -> list[_Bucket]:
    if not sharded:
        return [_Bucket(i, g, 0) for i, g in enumerate(groups)]
    load = [0] * world_size
    owners = {}
    for i in sorted(range(len(groups)), key=lambda i: -sum(p.numel() for p in groups[i])):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sum(p.numel() for p in groups[i])
    return [_Bucket(i, g, owners[i]) for i, g in enumerate(groups)]


def settle_buckets(ddp: DDP, x) -> None:
    """Let DDP cut its buckets for good now: one forward and backward of the input `x`, whose gradients DDP
    averages across the ranks and this then drops. DDP re-cuts its buckets by the order in which that backward
    made them ready, at the next forward, and never again; the random generators are left as they were."""
    module = ddp.module
    device = next(module.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        sum(t.float().sum() for t in _tensors(ddp(x))).backward()  # every output: the state's too
    for p in module.parameters():
        p.grad = None


def one_token(module: torch.nn.Module) -> torch.Tensor:
    """A one-token input of a RecurrentLM: a token id, or its activations where the embedding is elsewhere."""
    device = next(module.parameters()).device
    if module.embed is not None:
        return torch.zeros(1, 1, dtype=torch.long, device=device)
    return torch.zeros(1, 1, module.cfg.d_model, device=device)


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of an output (nested lists and tuples: logits and the recurrent state), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for s in out for t in _tensors(s)] if isinstance(out, (list, tuple)) else []


def build_sync(model: torch.nn.Module, cfg: CommConfig, *, rank: int, world_size: int, distributed: bool,
               powersgd_start: int = 2, seed: int = 0, group=None, parts: list[torch.nn.Module] | None = None,
               predictions: dict | None = None) -> GradientSync:
    """The mode of `cfg` over `world_size` data-parallel ranks: every rank, or the ranks of `group` (the dp
    dimension of a pipeline mesh, where only all-reduce runs: config validation refuses the others).
    `parts`: the pieces of `model` that run separately (AllReduceSync); `predictions`: what comm.mode = "auto"
    chose the mode by (choose_mode), for the run's reports."""
    if not distributed or world_size == 1:
        return GradientSync(model)
    mode = cfg.mode
    if mode == "auto":
        raise ValueError("comm.mode = 'auto' is resolved before the sync is built (choose_mode; rpt/train/resolve.py)")
    if mode == "diloco":
        sync = DiLoCoSync(model, cfg, world_size, group=group)
    elif mode == "allreduce":
        sync = AllReduceSync(model, cfg, world_size, powersgd_start=powersgd_start, seed=seed, group=group,
                             parts=parts)
    else:
        sync = ParameterServerSync(model, cfg, rank, world_size, sharded=mode == "ps-sharded")
    sync.mode, sync.predictions = mode, predictions
    return sync


# the share of a mode's fp32 synchronisation time that half-width gradients take: all of an all-reduce's traffic
# is gradients; a server's is half gradients, half parameters (which always travel in full precision)
HALF_WIDTH_SHARE = {"allreduce": 0.5, "ps": 0.75, "ps-sharded": 0.75}
HALF_WIDTH_WORTH = 0.005  # seconds a step a half-width codec must save to be chosen


def choose_mode(grad_bytes: int, cfg: CommConfig, precision: str) -> tuple[str, str, dict]:
    """`comm.mode = "auto"`: measure the links and time each mode's traffic pattern (every rank gets the same
    numbers), and take the fastest mode the other settings allow (the servers take neither fp16 loss
    scaling nor powersgd/topk). With `comm.compression = "none"` it chooses the codec too, among those that
    do not change what a step learns: bf16 gradients where they save at least HALF_WIDTH_WORTH a step.
    powersgd, topk and diloco stay the user's to choose. `grad_bytes`: the model's fp32 gradient bytes.
    Returns the mode, the codec, and the seconds per step they were chosen by."""
    topo = links.measure(message_mb=1.0, repeats=2)
    predictions = links.predict(topo, grad_bytes)
    timed = links.time_modes(grad_bytes)
    allowed = ["allreduce"]
    if precision != "fp16" and cfg.compression in ("none", "fp16", "bf16") and not cfg.adaptive:
        allowed += ["ps", "ps-sharded"]
    mode = links.fastest({m: t for m, t in timed.items() if m in allowed})
    codec = cfg.compression
    if codec == "none" and not cfg.adaptive:
        saved = timed[mode] - min(timed[m] * HALF_WIDTH_SHARE[m] for m in allowed)
        if saved >= HALF_WIDTH_WORTH:
            mode = links.fastest({m: timed[m] * HALF_WIDTH_SHARE[m] for m in allowed})
            codec = "bf16"
    log.info("comm.mode auto: model %s, timed %s (seconds per step); chose %s with compression %s\n%s", predictions,
             timed, mode, codec, links.format_table(topo, predictions, grad_bytes, timed))
    return mode, codec, {"model": predictions, "timed": timed, "compression": codec,
                  "predicted_seconds": timed[mode] * (HALF_WIDTH_SHARE[mode] if codec in ("fp16", "bf16") else 1)}
