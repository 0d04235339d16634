"""Matrix products in the weight layouts the CPU runs fastest, where torch's default GEMM is slow.

- `PackedLinear`: h @ W.T (+ add) for the small-batch products inside a recurrent loop. With B as small as 1 or
  2 rows, torch's default (MKL) GEMM is several times slower than oneDNN with the weight packed once per
  sequence, and with the fewest rows rpt's own product (small_batch_product.cpp) beats oneDNN in turn, whose
  every call pays a fixed cost: the layout is chosen per weight and batch (`Layout`).
- `linear` / `matmul`: F.linear for the sequence-sized projections of the cells, on oneDNN with the weight packed
  at each call (faster than MKL for their forward and input-gradient products; the weight gradient stays a plain
  GEMM). Small calls keep F.linear, as do autocast, other dtypes and devices.
- `generating(tokens)`: a generation's one-row products (every F.linear of a step) on rpt's small-batch product,
  on a packing of each weight kept for the generation; `RowProducts` also runs a server's decode batches.

Where oneDNN's ops are missing, off the CPU, or not float32, all of these fall back to addmm, so results never
depend on them (figures: benchmarks/results/cells.md).
"""

from __future__ import annotations

import contextlib
import weakref
from enum import IntEnum
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rpt.kernels.backend import Backend

MIN_ROWS = 1024  # below this many rows packing the weight at each call costs more than it saves


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Few rows and a small enough W: rpt's own product reads W once per three rows of h, and the native loops run it with
# the step's elementwise part split over the same threads; faster than oneDNN's product while that traffic stays
# within SMALL_BATCH_TRAFFIC, and at any number of rows for a W that stays in the threads' L2 caches (the crossovers
# of a grid of modlstm and gru forward + backward, benchmarks/results/cells.md).
SMALL_BATCH_TRAFFIC = 16 << 20  # bytes a step: ceil(rows / 3) x W
CACHED_WEIGHT = 1 << 20  # bytes


class Layout(IntEnum):
    """How PackedLinear holds W (the native loops take the code)."""
    PLAIN = 0  # the weight as it is: addmm (off the CPU, other dtypes)
    ONEDNN = 1  # oneDNN's reordered weight
    SMALL_BATCH = 2  # rpt's small-batch packing (the native loops must be built)


class PackedLinear:
    """h @ W.T (+ add) in the layout that suits `batch` rows on `backend`. `operand` is (packed weight, layout
    code), what the native loops take."""

    def __init__(self, weight: torch.Tensor, batch: int, backend: Backend):
        self.weight, self.operand = weight, (weight, int(Layout.PLAIN))
        self.ops = None
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        ops = backend.loops()
        few = (batch <= 2 or weight.nbytes <= CACHED_WEIGHT
               or -(-batch // 3) * weight.nbytes <= SMALL_BATCH_TRAFFIC)
        if ops is not None and few and backend.small_batch:
            self.ops, self.operand = ops, (ops.pack_for_small_batch(weight.detach()), int(Layout.SMALL_BATCH))
        elif _packed_available():
            try:
                self.operand = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch), int(Layout.ONEDNN))
            except RuntimeError:
                pass

    def __call__(self, h: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        w, layout = self.operand
        if layout == Layout.SMALL_BATCH:
            return self.ops.small_batch_product(h, w, self.weight.shape[0], add)
        if layout == Layout.ONEDNN:
            if add is None:
                return torch.ops.mkldnn._linear_pointwise(h, w, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(h, add, w, None, "add")
        if add is None:
            return h @ self.weight.T
        return torch.addmm(add, h, self.weight.T)


def _on_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() >= MIN_ROWS * x.shape[-1]
            and not torch.is_autocast_enabled("cpu") and _packed_available())


class RowProducts:
    """F.linear for generation and serving, with no gradient wanted and a float32 CPU parameter as weight (or a
    bfloat16 one, on oneDNN only: the two-level head's screen, TwoLevelDecoding._rarer_may_win), on a
    packing of the weight made at its first use and kept until the weight changes (its in-place version counter
    moves) or dies: on at most two rows rpt's small-batch product, on a step's [rows, features] of up to
    `MANY_ROWS` rows (a server's decode batch) oneDNN's product on its reordered weight; F.linear otherwise (a
    prompt's sequence). A generated token reads every matrix once, and MKL's GEMM reads them at a fraction of the
    memory's speed (a 32,768 x 256 head: 2.2 ms for 10 rows against oneDNN's 0.9, benchmarks/results/serve.md)."""

    MANY_ROWS = 256

    def __init__(self, ops):
        self.ops, self.packs = ops, {}  # (id(weight), layout) -> (weakref to it, its _version when packed, packing)

    @classmethod
    def of(cls, backend: Backend) -> "RowProducts | None":
        """The backend's packed products, where its native loops are built (None elsewhere)."""
        ops = backend.loops()
        return cls(ops) if ops is not None else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = x.numel() // weight.shape[-1]
        layout = Layout.SMALL_BATCH if n <= 2 and weight.dtype == torch.float32 else Layout.ONEDNN
        if (not isinstance(weight, nn.Parameter) or weight.device.type != "cpu" or x.dtype != weight.dtype
                or weight.dtype not in (torch.float32, torch.bfloat16)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or (layout == Layout.ONEDNN and (n > self.MANY_ROWS or x.dim() != 2 or not _packed_available()))):
            return F.linear(x, weight, bias)
        key = (id(weight), layout)
        held = self.packs.get(key)
        if held is None or held[0]() is not weight or held[1] != weight._version:
            w = weight.detach()
            packed = self.ops.pack_for_small_batch(w) if layout == Layout.SMALL_BATCH else _pack(w, 16)
            self.packs[key] = held = (weakref.ref(weight, lambda _, k=key: self.packs.pop(k, None)), weight._version,
                                      packed)
        rows = x.reshape(-1, x.shape[-1])
        if layout == Layout.SMALL_BATCH:
            y = self.ops.small_batch_product(rows, held[2], weight.shape[0],
                                             None if bias is None else bias.expand(len(rows), -1))
        else:  # rows padded to a power of two: oneDNN keeps memory for each shape it has run
            padded = 1 << (n - 1).bit_length()
            if padded != n:
                rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), held[2], bias, "none", [], "")[:n]
        return y.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def row_products(model: nn.Module, products: RowProducts):
    """Inside this block every product of `model`'s steps runs `products`: each nn.Linear's, and each cell's
    (a cell's step forms call `self.linear`, F.linear by default). Applied from outside and undone on leaving."""
    swapped = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = lambda x, m=module: products(x, m.weight, m.bias)
            swapped.append((module, "forward"))
        elif getattr(module, "linear", None) is F.linear:
            module.linear = products
            swapped.append((module, "linear"))
    try:
        yield
    finally:
        for module, name in swapped:
            delattr(module, name)


def generating(model: nn.Module, tokens: Iterator[int], products: RowProducts) -> Iterator[int]:
    """`tokens = decoder.generate(...)` with the model's one-row products on `products` (the first `next` builds
    the native code, before any token is out) until it ends; then the products are F.linear again and the packings
    go, so no copy of the weights outlives it. (While it is suspended the model computes the same: a call that wants
    gradients, or has more rows, is F.linear's.) A decoder built with the same `products` runs its own on them."""
    try:
        with row_products(model, products):
            yield from tokens
    finally:
        products.packs.clear()


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
