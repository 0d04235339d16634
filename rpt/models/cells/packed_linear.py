"""h @ W.T (+ add) for the small-batch matrix products inside a recurrent loop.

Inside a time loop the product is [B, H] x [H, 4H] with B as small as 1 or 2: on the build
machine's CPU, torch's default (MKL) GEMM runs it about 3x slower than oneDNN with the weight
packed once per sequence (measured: 57 us vs 171 us at B=2, H=512; 186 us vs 296 us at B=16).
The packed path uses the oneDNN ops that torch's own inductor CPU backend calls; where they are
missing, or off the CPU, or not float32, this falls back to addmm, so results never depend on it.
"""

from __future__ import annotations

import torch


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear:
    def __init__(self, weight: torch.Tensor, batch: int):
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _packed_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch)
            except RuntimeError:
                self.packed = None

    @property
    def operand(self) -> tuple[torch.Tensor, bool]:
        """(packed weight, True) or (plain weight, False): what the native loops (rpt.models.cells.native) take."""
        return (self.packed, True) if self.packed is not None else (self.weight, False)

    def __call__(self, h: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            if add is None:
                return torch.ops.mkldnn._linear_pointwise(h, self.packed, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(h, add, self.packed, None, "add")
        if add is None:
            return h @ self.weight.T
        return torch.addmm(add, h, self.weight.T)
