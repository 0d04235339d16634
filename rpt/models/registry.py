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

import dataclasses
import difflib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.ops.modlstm.spec import GATES as BUILT_IN_GATES
from rpt.kernels.triton import GATE_FORMS

CELLS: dict[str, type] = {}
GATES: dict[str, "GateFunction"] = {}


def register_cell(name: str):
    def add(cls):
        cls.name = name
        CELLS[name] = cls
        return cls
    return add


def check_names(cfg, search: list[Path] = ()) -> None:
    """model.cell and model.gate name registered ones (after importing model.imports, which may register them),
    or the error says which are, with a did-you-mean. `cfg` is a ModelConfig; `search`: the config file's folder.
    (The built-in cells are registered by then: importing this module ran rpt/models/__init__.py.)"""
    import_user_modules(cfg.imports, list(search))
    cls = get_cell(cfg.cell)
    check_options(cfg, cls)
    if "gate" in cls.options:
        get_gate(cfg.gate)


def cell_options() -> dict[str, object]:
    """The model options some registered cell declares (each cell's `options`), with ModelConfig's default for
    each: the value that means "not used". A cell that does not declare one refuses it set."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {name: defaults[name] for cls in CELLS.values() for name in cls.options}


def check_options(cfg, cls: type) -> None:
    """Refuse a model option set away from its default for a cell that does not take it."""
    unused = [k for k, default in cell_options().items() if getattr(cfg, k) != default and k not in cls.options]
    if unused:
        keys = ", ".join(f"model.{k}" for k in unused)
        takers = sorted(name for name, c in CELLS.items() if set(unused) <= set(c.options))
        raise RptError(f"{keys} {'applies' if len(unused) == 1 else 'apply'} to model.cell = "
                       f"{' or '.join(repr(t) for t in takers) or 'no registered cell'} (the cell is '{cfg.cell}')",
                       f"set model.cell = {takers[0]!r}, or leave {keys} at the default" if takers else
                       f"leave {keys} at the default")


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'? " if close else ""


def get_cell(name: str) -> type:
    if name not in CELLS:
        raise RptError(f"unknown cell '{name}'", _did_you_mean(name, list(CELLS)) +
                       f"model.cell must be one of {', '.join(sorted(CELLS))}, or a cell of your own registered with "
                       "register_cell in a module named in model.imports (docs/cells.md)")
    return CELLS[name]


def import_user_modules(modules: list[str], search: list[Path] = ()) -> None:
    """Import model.imports, which may register cells and gates. A module is looked for where Python looks, then
    in the working directory and the `search` folders (the config file's), so that `rpt` finds a module beside
    the user as `python -m rpt` does."""
    for folder in [Path.cwd(), *search]:
        if str(folder) not in sys.path and str(folder.resolve()) not in sys.path:
            sys.path.append(str(folder.resolve()))
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise RptError(f"model.imports: cannot import '{module}': {exc}",
                           "put the module in the working directory or beside the config file, install it, "
                           "or add its folder to PYTHONPATH") from None


@dataclass(frozen=True)
class GateFunction:
    """A gate nonlinearity for the modified LSTM.

    `fn(x)` maps a pre-activation to the gate value; `grad(x, y)` is dy/dx given x and y = fn(x),
    used by the fused kernel's hand-written backward. Gates should map into [0, 1]. `forget_bias` is the
    forget gate's initial bias that suits this gate (`model.forget_bias = "auto"` takes it). `triton`: the same
    two as `triton.jit` functions of Triton blocks, (fn, grad), for the GPU's one-kernel loop (without them a
    head-wise modlstm on a GPU runs its step loop instead, and says so).
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    forget_bias: float = 1.0
    triton: tuple | None = None


# The exponential gate's forget bias: f = exp(P_f) weighs the carried average against each new input, so
# a positive bias (f > 1) makes the normalised state hold on to the first tokens and ignore new ones: with
# the sigmoid's +1 the model did not learn (validation rose at every evaluation); from -1 to -3 it learned
# as well as or better than the sigmoid gate (benchmarks/RESULTS.md). At -1 the state keeps 1/e of its past
# per step at the start, as xLSTM's sLSTM starts its forget gate well below saturation.
EXP_FORGET_BIAS = -1.0


def register_gate(name: str, fn: Callable, grad: Callable, forget_bias: float = 1.0,
                  triton: tuple | None = None) -> GateFunction:
    if name == "exp":
        raise RptError("'exp' is the built-in stabilised exponential gate", "register your gate under another name")
    gate = GateFunction(name, fn, grad, forget_bias, triton)
    GATES[name] = gate
    if triton is not None:
        GATE_FORMS[name] = triton
    return gate


def default_forget_bias(gate: str) -> float:
    """The forget gate's initial bias for a gate function by name (what model.forget_bias = "auto" means)."""
    return EXP_FORGET_BIAS if gate == "exp" else get_gate(gate).forget_bias


def get_gate(name: str) -> GateFunction | None:
    """The gate function by name; None for 'exp', which the modified LSTM handles as a stabilised special case."""
    if name == "exp":
        return None
    if name not in GATES:
        raise RptError(f"unknown gate function '{name}'", _did_you_mean(name, ["exp", *GATES]) +
                       f"model.gate must be one of exp, {', '.join(sorted(GATES))}, or a gate of your own registered "
                       "with register_gate in a module named in model.imports (docs/cells.md)")
    return GATES[name]


for _name, (_fn, _grad) in BUILT_IN_GATES.items():  # the spec's (rpt/ops/modlstm/spec.py), which export ships
    register_gate(_name, _fn, _grad)
