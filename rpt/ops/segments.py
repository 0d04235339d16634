"""Running a whole-sequence kernel that cannot reset mid-sequence (torch's LSTM and GRU) on batches that do."""

from __future__ import annotations

import functools
import sys
import weakref

import torch

State = tuple[torch.Tensor, ...]


def reset_rows(state: State, mask: torch.Tensor) -> State:
    """Zero the rows of every state tensor where mask (bool [B]) is set."""
    keep = (~mask).to(state[0].dtype)
    return tuple(s * keep.view(-1, *[1] * (s.dim() - 1)) for s in state)


_last_mask: tuple = (lambda: None, [])


def reset_columns(reset: torch.Tensor | None) -> list[int]:
    """The columns where some row resets. Every block of a forward is handed the same mask, and on a GPU
    reading it is a host synchronisation: it is read once per mask (the last one is remembered)."""
    global _last_mask
    if reset is None:
        return []
    if _last_mask[0]() is not reset:
        _last_mask = (weakref.ref(reset), torch.nonzero(reset.any(dim=0)).flatten().tolist())
    return _last_mask[1]


def eager_under_compile(fn):
    """`torch.compiler.disable(fn)`, made at the first call once torch._dynamo is loaded: the decorator itself
    imports torch._dynamo, two seconds of every process's start, which only a compiled model needs (and nothing
    is compiled before torch._dynamo is loaded)."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call


@eager_under_compile
def over_segments(run, x: torch.Tensor, state: State, reset: torch.Tensor | None):
    """Run a whole-sequence kernel that cannot reset mid-sequence (nn.LSTM, nn.GRU) between reset columns.

    The sequence is cut at every column where some row resets; documents are long next to a
    training window, so most batches are one or two segments.

    Inside a compiled model this runs eagerly (a graph break): traced, torch's LSTM for training becomes
    per-step products in place of oneDNN's kernel (the shakespeare model's step took twice as long), and the
    cut would be read from the mask's values, which a graph cannot hold (the remembered columns of the last
    mask became constants of the graph: a new mask ran with the old cut).
    """
    cols = reset_columns(reset)
    if not cols:
        return run(x, state)
    bounds = sorted(set([0, *cols, x.shape[1]]))
    ys = []
    for a, b in zip(bounds, bounds[1:]):
        state = reset_rows(state, reset[:, a])
        y, state = run(x[:, a:b], state)
        ys.append(y)
    return torch.cat(ys, dim=1), state
