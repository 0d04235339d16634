"""What the GPU backend's loop kernels share (rpt/ops/CELL/triton.py): the autotuned launch, a program's place in
the (head, batch block) grid, a head's recurrent blocks read onto the chip, the padded width, and the recurrent
matrix's gradient as one batched product outside the loop."""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_B = 16  # rows a program carries: tl.dot needs 16 or more on each side


def tuned(*key: str):
    """triton.autotune over the warps a program runs: a loop kernel is latency-bound and holds its blocks in
    registers, so which count wins depends on the head width and the GPU; timed at the first call of each key. Heads
    of 16 units try 2 and 4 warps, wider ones 4 and 8 (2 spill kilobytes a thread there:
    benchmarks/cells/triton_compile.py), so each width compiles twice. One config under the interpreter, which cannot
    time. The loop kernels only write their outputs (nothing is accumulated in place), so running one several times
    while timing leaves the same results."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return triton.autotune([triton.Config({}, num_warps=4)], key=list(key))
    return triton.autotune([triton.Config({}, num_warps=w) for w in (2, 4, 8)], key=list(key),
                           prune_configs_by={"early_config_prune": _warps_for_width})


def _warps_for_width(configs, named_args, **kwargs):
    wide = kwargs.get("DP", named_args.get("DP", 64)) > 16
    return [c for c in configs if c.num_warps in ((4, 8) if wide else (2, 4))]


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _program(B, heads, D: tl.constexpr, DP: tl.constexpr, BB: tl.constexpr):
    """This program's head j, batch block pb, rows b, units u (D of them, padded to DP), the width H, and the mask
    [BB, DP] of its real rows and units."""
    pb = tl.program_id(1)
    b = pb * BB + tl.arange(0, BB)
    u = tl.arange(0, DP)
    return tl.program_id(0), pb, b, u, heads * D, (b < B)[:, None] & (u < D)[None, :]


@triton.jit
def _load_blocks(R, j, heads, rows, cols, D: tl.constexpr):
    """Head j's four [D, D] blocks of R (gates x heads x D x D, out x in), each read as [rows, cols] offsets (zero
    past D)."""
    return (_block(R, 0, j, heads, rows, cols, D), _block(R, 1, j, heads, rows, cols, D),
            _block(R, 2, j, heads, rows, cols, D), _block(R, 3, j, heads, rows, cols, D))


@triton.jit
def _block(R, g, j, heads, rows, cols, D: tl.constexpr):
    """Group g's block of head j in R [groups, heads, D, D], at [rows, cols] offsets, zero past D."""
    return tl.load(R + (g * heads + j) * D * D + rows * D + cols, mask=(rows < D) & (cols < D), other=0.0).to(
        tl.float32)


def padded(d: int) -> int:
    """A head's width as the kernels lay it out: a power of two (tl.arange), 16 or more (tl.dot)."""
    return max(16, triton.next_power_of_2(d))


def _precision(t: torch.Tensor) -> str:
    return "tf32" if t.is_cuda else "ieee"


def recurrent_grad(dgx: Tensor, hs: Tensor, h0: Tensor, keep: Optional[Tensor], heads: int) -> Tensor:
    """The gradient of the recurrent blocks R [G, heads, d, d] from that of the pre-activations dGX [T, B, G*H]:
    dR_g = sum over steps and rows of dGX_g^T h_{t-1} (h_{t-1} after the step's reset), head by head, as one
    batched product. Summed in the loop kernels instead, the four [d, d] accumulators and their products per step
    spilled registers at heads of 48-64 units (benchmarks/cells/triton_compile.py)."""
    T, B, H = hs.shape
    d = H // heads
    h_prev = torch.cat([h0.to(hs.dtype)[None], hs[:-1]])
    if keep is not None:
        h_prev = h_prev * keep[:, :, None]
    # contiguous, as the operators' fake forms say (einsum may hand back a permuted view)
    grad = torch.einsum("ngjo,nji->gjoi", dgx.reshape(T * B, -1, heads, d), h_prev.reshape(T * B, heads, d))
    return grad.contiguous()
