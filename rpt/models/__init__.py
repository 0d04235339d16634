"""Recurrent language models. They know nothing of how they are run: parallelism is applied from outside
(rpt.parallel.apply)."""

from rpt.models import cells as _cells  # noqa: F401  (registers the built-in cells)
from rpt.models.lm import RecurrentLM
from rpt.models.registry import register_cell, register_gate

__all__ = ["RecurrentLM", "register_cell", "register_gate"]
