"""Recurrent language models. Nothing here imports torch.distributed: parallelism is applied from outside."""

from rpt.models import cells as _cells  # noqa: F401  (registers the built-in cells)
from rpt.models.lm import RecurrentLM
from rpt.models.registry import register_cell, register_gate

__all__ = ["RecurrentLM", "register_cell", "register_gate"]
