"""Registries of recurrent cells and gate functions, so users add their own by name (the gates are modlstm's:
rpt/ops/modlstm/gates.py keeps them, and this module gives them out beside the cells).

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
import importlib
import sys
from pathlib import Path

from rpt.config import ModelConfig
from rpt.errors import RptError, did_you_mean
from rpt.ops.modlstm.gates import GATES, GateFunction, default_forget_bias, get_gate, register_gate  # noqa: F401

CELLS: dict[str, type] = {}


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


def get_cell(name: str) -> type:
    if name not in CELLS:
        raise RptError(f"unknown cell '{name}'", did_you_mean(name, list(CELLS)) +
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


