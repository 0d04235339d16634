"""The gated delta rule over a window: which form runs it (`forms`, asked of the backend once per call), and
running it: flash-linear-attention's kernel (library.py) on CUDA where fla-core is installed, else rpt's
chunkwise form in torch (chunkwise.py), on any device.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.ops.gdn import library
from rpt.ops.gdn.chunkwise import chunkwise


def forms(x: Tensor) -> set[Form]:
    return {Form.LIBRARY, Form.ATEN} if x.is_cuda and library.kernel() is not None else {Form.ATEN}


def forward(q, k, v, g, beta, reset: Optional[Tensor], S: Tensor, chunk: int):
    """As chunkwise.chunkwise (the same arguments and results)."""
    if kernels.current().form(q, forms(q)) is Form.LIBRARY:
        return library.by_sequences(library.kernel(), q, k, v, g.float(), beta, reset, S.float())
    return chunkwise(q, k, v, g, beta, reset, S, chunk)
