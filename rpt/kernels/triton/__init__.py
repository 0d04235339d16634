"""The GPU backend: the recurrent time loops as Triton kernels, a program per (head, batch block) holding its
head's recurrent blocks on chip for the whole sequence (FlashRNN's layout). Every kernel here also runs on the
CPU under TRITON_INTERPRET=1, where the tests hold it to the float64 reference; on a GPU it compiles.
"""

from __future__ import annotations

import importlib.util

HEAD_WIDTHS = (16, 32, 64)  # a head's state on chip: tl.arange needs a power of two, tl.dot 16 or more


def on_chip(d_hidden: int, heads: int) -> bool:
    """Whether a head of `d_hidden / heads` units fits the Triton loops (and triton is installed)."""
    return d_hidden // heads in HEAD_WIDTHS and importlib.util.find_spec("triton") is not None
