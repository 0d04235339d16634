"""A time loop of small kernels replayed as one CUDA graph.

A wide recurrence's step is a cuBLAS product and one fused pointwise kernel: launched from Python each costs
several microseconds of host time, about as much as the step's GPU work at a training batch, so the GPU waits on
the host. Captured once for a set of shapes, the whole loop is one launch. torch.cuda.graphs' make_graphed_callables
captures autograd graphs of modules; these loops sit inside a custom operator (below autograd, opaque to
torch.compile), so they are captured here, by their own rules:

- a graph reads and writes fixed ("static") tensors: the inputs are copied in before a replay and the outputs
  copied out after (one pass over each at memory speed, small next to the loop);
- a loop is captured after one warm-up run on a side stream (Triton compiles and cuBLAS picks its kernels there);
- the last few graphs are kept (training replays one forward and one backward shape; evaluation adds one);
- inside a capture already under way (torch.compile's mode="reduce-overhead") the loop runs as it is, into the
  outer graph; on the CPU (the tests, under Triton's interpreter) it runs as it is; where a capture fails, the
  loop runs uncaptured, with a warning.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

KEPT = 6
FAILED = ("failed",)  # kept in place of a graph whose capture failed: that loop runs uncaptured
_graphs: OrderedDict = OrderedDict()


def replay(loop: Callable, flags: tuple, inputs: list[Optional[Tensor]], outputs: list[Optional[Tensor]]) -> list:
    """`loop(flags, inputs, outputs)`, which fills `outputs` and returns some tensors, as a CUDA graph captured at
    the first call for these flags and these tensors' shapes, dtypes and devices."""
    if uncaptured(next(t for t in inputs if t is not None)):
        return loop(flags, inputs, outputs)
    key = (loop, flags, *(_signature(t) for t in (*inputs, *outputs)))
    entry = _graphs.pop(key, None)
    if entry is None:
        try:
            entry = _capture(loop, flags, inputs, outputs)
        except RuntimeError as exc:  # the loop still runs, launched step by step
            warnings.warn(f"the recurrent loop could not be captured as a CUDA graph ({exc}); it runs launched step "
                          "by step, several times slower", stacklevel=3)
            entry = FAILED
    _graphs[key] = entry
    while len(_graphs) > KEPT:
        _graphs.popitem(last=False)
    if entry is FAILED:
        return loop(flags, inputs, outputs)
    graph, static_in, static_out, results = entry
    for static, t in zip(static_in, inputs):
        if t is not None:
            static.copy_(t)
    graph.replay()
    for static, t in zip(static_out, outputs):
        if t is not None:
            t.copy_(static)
    return [r.clone() if r is not None else None for r in results]


def uncaptured(t: Tensor) -> bool:
    """A CPU tensor, or a capture already under way: the loop runs as it is."""
    return not t.is_cuda or torch.cuda.is_current_stream_capturing()


def _signature(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _capture(loop, flags, inputs, outputs):
    static_in = [t.clone() if t is not None else None for t in inputs]
    static_out = [torch.empty_like(t) if t is not None else None for t in outputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop(flags, static_in, static_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a loader thread may touch the GPU
        results = loop(flags, static_in, static_out)
    return graph, static_in, static_out, results


def clear() -> None:
    """Drop every kept graph and its static tensors."""
    _graphs.clear()
