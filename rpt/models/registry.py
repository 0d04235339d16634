"""Registries of recurrent cells and gate functions, so users add their own by name.

    from rpt.models import register_cell, register_gate

    register_gate("softsign01", fn=lambda x: 0.5 + 0.5 * x / (1 + x.abs()),
                  grad=lambda x, y: 0.5 / (1 + x.abs()) ** 2)

    @register_cell("mycell")
    class MyCell(Cell): ...          # see rpt.models.cells.base.Cell

After registration, `model.cell = "mycell"` or `model.gate = "softsign01"` in a config uses it;
nothing in rpt needs to change. docs/cells.md walks through both with a worked example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rpt.errors import RptError

CELLS: dict[str, type] = {}
GATES: dict[str, "GateFunction"] = {}


def register_cell(name: str):
    def add(cls):
        cls.name = name
        CELLS[name] = cls
        return cls
    return add


def get_cell(name: str) -> type:
    if name not in CELLS:
        raise RptError(f"unknown cell '{name}'", f"model.cell must be one of {', '.join(sorted(CELLS))} "
                       "(or a cell registered with rpt.models.register_cell)")
    return CELLS[name]


@dataclass(frozen=True)
class GateFunction:
    """A gate nonlinearity for the modified LSTM.

    `fn(x)` maps a pre-activation to the gate value; `grad(x, y)` is dy/dx given x and y = fn(x),
    used by the fused kernel's hand-written backward. Gates should map into [0, 1].
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def register_gate(name: str, fn: Callable, grad: Callable) -> GateFunction:
    if name == "exp":
        raise RptError("'exp' is the built-in stabilised exponential gate", "register your gate under another name")
    gate = GateFunction(name, fn, grad)
    GATES[name] = gate
    return gate


def get_gate(name: str) -> GateFunction | None:
    """The gate function by name; None for 'exp', which the modified LSTM handles as a stabilised special case."""
    if name == "exp":
        return None
    if name not in GATES:
        raise RptError(f"unknown gate function '{name}'",
                       f"model.gate must be one of exp, {', '.join(sorted(GATES))} (or one registered with register_gate)")
    return GATES[name]


register_gate("sigmoid", torch.sigmoid, lambda x, y: y * (1 - y))
register_gate("hard_sigmoid", lambda x: torch.clamp(x / 6 + 0.5, 0.0, 1.0),
              lambda x, y: ((x > -3) & (x < 3)).to(x.dtype) / 6)
