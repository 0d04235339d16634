"""What every rank measures per step, and the one small collective that brings it to rank 0.

Each rank times its phases (data wait, forward, backward, optimiser, checkpoint, evaluation: the trainer's
PhaseClock), takes the exposed
communication from the comm meter, its memory (CUDA peak, or the process's resident set), and the
RMS of the recurrent state it carries per layer. Every log interval the ranks all-gather one
fixed-size float64 vector each (`pack`), and rank 0 writes the rows to the store.

A rank's *compute* is forward + backward + optimiser minus the exposed communication wait (DDP
waits for its last buckets inside backward). Stragglers are ranked by that, never by time spent in
a collective: the fast ranks are the ones that wait longest there.
"""

from __future__ import annotations

import math
import resource

import torch
import torch.distributed as dist

PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "eval")
FIELDS = ("step", "time", "loss", "tokens_per_s", "step_s", *(f"{p}_s" for p in PHASES), "exposed_comm_s",
          "comm_s", "comm_bytes", "compute_s", "memory_bytes", "stage", "bubble")


def memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * resource.getpagesize())
    except OSError:
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def state_rms(state, layers, n_layers: int) -> list[float]:
    """RMS of each block's carried cell state; `layers` names the block of each state entry (NaN for layers
    this rank does not hold)."""
    out = [math.nan] * n_layers
    for layer, (cell, _attn) in zip(layers, state):
        tensors = [t for t in _flatten(cell) if torch.is_tensor(t) and t.is_floating_point()]
        if tensors:
            total = sum(float(t.detach().float().pow(2).sum()) for t in tensors)
            count = sum(t.numel() for t in tensors)
            out[layer] = math.sqrt(total / max(count, 1))
    return out


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def pack(record: dict, state_norms: list[float]) -> torch.Tensor:
    return torch.tensor([float(record.get(k, math.nan)) for k in FIELDS] + state_norms, dtype=torch.float64)


def unpack(row: torch.Tensor) -> tuple[dict, list[float]]:
    values = row.tolist()
    return dict(zip(FIELDS, values[:len(FIELDS)])), values[len(FIELDS):]


def gather_rows(mine: torch.Tensor, world_size: int, enabled: bool) -> list[torch.Tensor]:
    """Every rank's vector on every rank: one all-gather of a few hundred bytes per rank (gloo: CPU tensors)."""
    if not enabled:
        return [mine]
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return every


def stragglers(rows: list[dict], threshold: float = 1.2) -> list[dict]:
    """Ranks whose own compute per step exceeds the median of the ranks doing the same work (the same
    pipeline stage) by `threshold`: (rank, compute, median, ratio)."""
    found = []
    for stage in sorted({r["stage"] for r in rows}):
        peers = [r for r in rows if r["stage"] == stage]
        if len(peers) < 2:
            continue
        times = sorted(r["compute_s"] for r in peers)
        mid = len(times) // 2
        median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        # with two peers the median is their mean: compare against the faster one instead
        reference = times[0] if len(times) == 2 else median
        for r in peers:
            if reference > 0 and r["compute_s"] / reference > threshold:
                found.append({"rank": int(r["rank"]), "compute_s": r["compute_s"], "reference_s": reference,
                              "ratio": r["compute_s"] / reference})
    return found


class _GateRecorder(torch.overrides.TorchFunctionMode):
    """Counts, per layer, the outputs of bounded gate functions (sigmoid, hard sigmoid, tanh) that sit in their
    flat tails: sigmoid-like below 0.02 or above 0.98, tanh beyond +-0.98. Works for every cell, registered ones
    included, because the single-step forms call these torch functions. An mlstm's exponential input gate is
    unbounded and its forget gate (a log-sigmoid) starts near 1 by design: its output gate is what is counted."""

    SIGMOIDS = {torch.sigmoid, torch.Tensor.sigmoid, torch.nn.functional.hardsigmoid, torch.special.expit}
    TANHS = {torch.tanh, torch.Tensor.tanh, torch.nn.functional.tanh}

    def __init__(self, n_layers: int):
        super().__init__()
        self.layer = None
        self.saturated = [0] * n_layers
        self.total = [0] * n_layers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.layer is not None and isinstance(out, torch.Tensor) and (func in self.SIGMOIDS or func in self.TANHS):
            y = out.detach().float()
            flat = (y.abs() > 0.98) if func in self.TANHS else ((y < 0.02) | (y > 0.98))
            self.saturated[self.layer] += int(flat.sum())
            self.total[self.layer] += y.numel()
        return out


class InputProbe:
    """The first row's first tokens of each module's first input after `arm()`: what the gate-saturation probe
    re-runs, tokens or, on a later pipeline stage, the activations the stage received. `arm()` puts a forward
    pre-hook on each module that takes its input once and removes itself, so the steps that are not probed run
    no hook."""

    def __init__(self, modules: list[torch.nn.Module], tokens: int = 8):
        self.modules, self.tokens = modules, tokens
        self.inputs: list[torch.Tensor | None] = [None] * len(modules)
        self.hooks: list = [None] * len(modules)

    def arm(self) -> None:
        for i, module in enumerate(self.modules):
            if self.hooks[i] is None:
                self.hooks[i] = module.register_forward_pre_hook(lambda _m, args, i=i: self._take(i, args[0]))

    def _take(self, i: int, x: torch.Tensor) -> None:
        self.inputs[i] = x[:1, :self.tokens].detach().clone()
        self.hooks[i].remove()
        self.hooks[i] = None


@torch.no_grad()
def gate_saturation(owner, inputs: torch.Tensor, state, n_layers: int, first_layer: int = 0) -> list[float]:
    """Share of saturated gate outputs per layer (NaN for layers `owner` does not hold), from the single-step
    forms run over `inputs` ([B, T]: a few rows of the last batch's tokens; on a later pipeline stage, of the
    activations it received) from `state`. `owner` is the model or a pipeline stage's view of it. The fast
    training paths (cuDNN/oneDNN LSTM, fused scans) do not expose their gates: this probe re-runs a few tokens through the readable step forms."""
    blocks, state = list(owner.blocks.values()), list(state)
    recorder = _GateRecorder(n_layers)
    inputs = inputs.float() if inputs.is_floating_point() else inputs  # activations arrive in the autocast dtype
    was_training = owner.training
    owner.eval()
    try:
        with recorder:
            for t in range(inputs.shape[1]):
                x = owner.embed(inputs[:, t]) if owner.embed is not None else inputs[:, t]
                for i, block in enumerate(blocks):
                    recorder.layer = first_layer + i
                    # the block's own forward, called past the module: eager where train.compile compiled the
                    # block (the recorder's counting would break its graph), and without hooks
                    x, state[i] = type(block).forward(block, x, state[i], step=True)
    finally:
        owner.train(was_training)
    return [s / t if t else math.nan for s, t in zip(recorder.saturated, recorder.total)]
