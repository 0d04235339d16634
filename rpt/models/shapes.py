"""Models built for their shapes only: the meta device, with the random initialisers skipped.

rpt builds meta models to count parameters and FLOPs before a run, and the tied head is made on meta before it
takes the embedding's matrix. On the meta device torch runs a random fill as a Python reference whose wrapper
imports torch._dynamo: two seconds of every process that builds a model, for values that do not exist.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
RANDOM_FILLS = {T.normal_, T.uniform_, T.random_, T.bernoulli_, T.exponential_, T.geometric_, T.log_normal_,
                T.cauchy_}


class _SkipRandomFillsOnMeta(TorchFunctionMode):  # (a dispatch mode would import torch._dynamo too)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init":  # all fill in place
            filled = args[0] if args else kwargs.get("tensor")
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """Modules built inside have their parameters on the meta device, uninitialised."""
    with torch.device("meta"), _SkipRandomFillsOnMeta():
        yield
