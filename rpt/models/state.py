"""Operations on a model's recurrent state: nested lists and tuples of [B, ...] tensors (a cell's state of any
shape, an attention cache), as the trainer, the runners and generation carry it between steps."""

from __future__ import annotations

from typing import Callable

import torch

def map_state(fn: Callable[[torch.Tensor], torch.Tensor], state):
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, (list, tuple)):
        return type(state)(map_state(fn, s) for s in state)
    return state


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor of its own, copied only where it is a view of another (a cell's last step, a reshaped
    loss): FSDP hooks a module's outputs for backward, and an in-place op on a view would lose that hook."""
    return t.clone() if not torch.compiler.is_compiling() and t._is_view() else t  # (a check dynamo cannot trace)


def shapes(state) -> list[tuple[int, ...]]:
    """The shapes of a state's tensors, in order: two states fit each other when these are equal."""
    found = []
    map_state(lambda t: found.append(tuple(t.shape)) or t, state)
    return found


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


def reset_rows(state, reset: torch.Tensor, fresh):
    """`state` with the rows where `reset` ([B] bool) is set taken from `fresh` (a fresh state of the same
    shapes): those rows start a new document, the others go on."""
    if isinstance(state, torch.Tensor):
        return torch.where(reset.view(-1, *[1] * (state.dim() - 1)), fresh, state)
    if isinstance(state, (list, tuple)):
        return type(state)(reset_rows(s, reset, f) for s, f in zip(state, fresh))
    return state


def all_finite(state) -> bool:
    ok = True

    def check(t):
        nonlocal ok
        ok = ok and bool(torch.isfinite(t).all())
        return t

    map_state(check, state)
    return ok
