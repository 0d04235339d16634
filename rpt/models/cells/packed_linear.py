"""Matrix products in the weight layouts the CPU runs fastest, where torch's default GEMM is slow.

`PackedLinear`: h @ W.T (+ add) for the small-batch products inside a recurrent loop.

Inside a time loop the product is [B, H] x [H, 4H] with B as small as 1 or 2: on the build
machine's CPU, torch's default (MKL) GEMM runs it about 3x slower than oneDNN with the weight
packed once per sequence (measured: 57 us vs 171 us at B=2, H=512; 186 us vs 296 us at B=16).
With the fewest rows rpt's own product (native/small_batch_product.cpp) beats oneDNN in turn, whose every
call pays a fixed ~18 us (in a time loop 34-40 us vs 58-67 us at B=2, H=512; 5.5 vs 23 at B=2, H=192):
PackedLinear packs the weight for it when the native loops are built and the rows are few, or the weight small
enough to stay in the cache (SMALL_BATCH_TRAFFIC and CACHED_WEIGHT below). The oneDNN path
uses the ops that torch's own inductor CPU backend calls; where they are missing, or off the CPU, or not
float32, this falls back to addmm, so results never depend on either.

`rows_linear(x, weight, bias)`: F.linear for generation's steps (one row per sequence), on the same
small-batch product inside `generation_products()`, with a packing per weight kept for the generation.

`linear(x, weight, bias)`: F.linear for the sequence-sized projections of the scan cells. Its forward and
input-gradient products, on oneDNN with the weight packed at each call, ran 10-20% faster than MKL one by one
on the build machine; a whole projection's forward and backward 8-10% faster (16 x 256 rows, 512 -> 2688:
172.6 ms against 188.9 ms with F.linear; 1344 -> 512: 84.5 against 93.0). The
weight gradient stays a plain GEMM: oneDNN would need a packed, transposed copy of the activations each step,
which costs what it gains. Small calls (generation's one row per step) keep F.linear, as do autocast,
other dtypes and devices. `matmul(x2, weight, bias)`: the same products for gru's and modlstm's own kernels,
which call them outside autograd.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rpt.models.cells import native

MIN_ROWS = 1024  # below this many rows packing the weight at each call costs more than it saves


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Few rows and a small enough W: rpt's own product (native/small_batch_product.cpp) reads W once per three rows of
# h, and the native loops run it with the step's elementwise part split over the same threads; faster than oneDNN's
# product while that traffic stays within SMALL_BATCH_TRAFFIC, and at any number of rows (measured to 128) for a W
# that stays in the threads' L2 caches (1 MB a core on the build machine): the crossovers of a grid of modlstm and
# gru forward + backward over H 192-864 and B 4-128 (benchmarks/RESULTS.md, session 10; beyond them the two tie).
SMALL_BATCH_TRAFFIC = 16 << 20  # bytes a step: ceil(rows / 3) x W
CACHED_WEIGHT = 1 << 20  # bytes
_small_batch = True


class PackedLinear:
    """h @ W.T (+ add) in the layout that suits `batch` rows: 2, rpt's small-batch product (the native loops
    must be built); 1, oneDNN's reordered weight; 0, the plain weight (addmm: off the CPU, other dtypes)."""

    def __init__(self, weight: torch.Tensor, batch: int):
        self.weight, self.operand = weight, (weight, 0)
        self.ops = None
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        ops = native.loops()
        few = (batch <= 2 or weight.nbytes <= CACHED_WEIGHT
               or -(-batch // 3) * weight.nbytes <= SMALL_BATCH_TRAFFIC)
        if ops is not None and few and _small_batch:
            self.ops, self.operand = ops, (ops.pack_for_small_batch(weight.detach()), 2)
        elif _packed_available():
            try:
                self.operand = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch), 1)
            except RuntimeError:
                pass

    def __call__(self, h: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        w, layout = self.operand
        if layout == 2:
            return self.ops.small_batch_product(h, w, self.weight.shape[0], add)
        if layout == 1:
            if add is None:
                return torch.ops.mkldnn._linear_pointwise(h, w, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(h, add, w, None, "add")
        if add is None:
            return h @ self.weight.T
        return torch.addmm(add, h, self.weight.T)


@contextlib.contextmanager
def onednn_products():
    """Inside this block PackedLinear leaves rpt's small-batch product out (for the native loops' self-test and
    the tests, which check the loops with either product)."""
    global _small_batch
    before, _small_batch = _small_batch, False
    try:
        yield
    finally:
        _small_batch = before


def _on_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() >= MIN_ROWS * x.shape[-1]
            and not torch.is_autocast_enabled("cpu") and _packed_available())


_row_packs: dict = {}  # id(weight) -> (weakref to it, its _version when packed, the packing)
_row_ops = None  # the native ops inside generation_products()


@contextlib.contextmanager
def generation_products():
    """Inside this block rows_linear runs rpt's small-batch product, on a packing of each weight made at its first
    use and kept for the next blocks until drop_row_packs(). `generating` holds it around each step of a generation
    and drops the packings when it ends, so that no copy of the weights outlives a generation; outside it (training's
    one-row calls, such as the gate probe) rows_linear is F.linear."""
    global _row_ops
    before, _row_ops = _row_ops, native.loops()  # built on first use, once per machine
    try:
        yield
    finally:
        _row_ops = before


def drop_row_packs() -> None:
    _row_packs.clear()


def generating(tokens: Iterator[int]) -> Iterator[int]:
    """`model.generate(...)` with every step inside generation_products() (the first `next` builds the native code,
    before any token is out), and the packings dropped when it ends: no copy of the weights outlives it."""
    try:
        while True:
            with generation_products():
                token = next(tokens, None)
            if token is None:
                return
            yield token
    finally:
        drop_row_packs()


def rows_linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); inside generation_products(), for at most two rows of x, no gradient wanted and a
    float32 CPU parameter as weight, rpt's small-batch product on a packing of the weight that is kept until the
    weight changes (its in-place version counter moves), dies, or is dropped. A generated token reads every
    matrix once, and MKL's GEMM reads them at a fraction of the memory's speed (lstm 4 x 256 + attention,
    vocabulary 8192: 60% of each token's time)."""
    ops = _row_ops
    if (ops is None or x.numel() > 2 * weight.shape[-1] or not isinstance(weight, nn.Parameter)
            or weight.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    key = id(weight)
    held = _row_packs.get(key)
    if held is None or held[0]() is not weight or held[1] != weight._version:
        packed = ops.pack_for_small_batch(weight.detach())
        _row_packs[key] = held = (weakref.ref(weight, lambda _, k=key: _row_packs.pop(k, None)), weight._version,
                                  packed)
    rows = x.reshape(-1, x.shape[-1])
    y = ops.small_batch_product(rows, held[2], weight.shape[0], None if bias is None else bias.expand(len(rows), -1))
    return y.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on oneDNN for large float32 CPU products (see the module docstring)."""
    return _OneDNNLinear.apply(x, weight, bias) if _on_onednn(x, weight) else F.linear(x, weight, bias)


def matmul(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 @ weight.T (+ bias) for 2-D x2, outside autograd: the sequence products inside the fused cells' own
    forward and backward (gru, modlstm). `weight` may be a transposed view (the input gradient's W)."""
    if _on_onednn(x2, weight):
        return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), _pack(weight, x2.shape[0]), bias, "none", [], "")
    return torch.addmm(bias, x2, weight.T) if bias is not None else x2 @ weight.T


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        y = matmul(x2, weight, bias)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # grad_y @ W: W.T packed as the weight (oneDNN reads the transposed view)
            grad_x = matmul(g2, weight.t()).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = g2.t() @ x2
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b
