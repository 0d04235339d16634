"""Operations on a model's recurrent state: nested lists and tuples of [B, ...] tensors."""

from __future__ import annotations

from typing import Callable

import torch


def map_state(fn: Callable[[torch.Tensor], torch.Tensor], state):
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, (list, tuple)):
        return type(state)(map_state(fn, s) for s in state)
    return state


def detach_state(state):
    """Cut the graph between training steps (truncated BPTT)."""
    return map_state(torch.Tensor.detach, state)


def rows(state, index):
    """The state of some batch rows (a slice or index tensor)."""
    return map_state(lambda t: t[index], state)


def cat_rows(states: list):
    """Inverse of taking consecutive row slices: join per-slice states along the batch."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=0)
    if isinstance(first, (list, tuple)):
        return type(first)(cat_rows([s[i] for s in states]) for i in range(len(first)))
    return first


def all_finite(state) -> bool:
    ok = True

    def check(t):
        nonlocal ok
        ok = ok and bool(torch.isfinite(t).all())
        return t

    map_state(check, state)
    return ok
