"""The exported cell's layer, as modeling_rpt.py imports it (`from .spec_cell import Layer`).

In an exported folder this file is the family's own spec, rpt/ops/FAMILY/spec.py, which `rpt export` writes here
under this name: the folder ships the one family it runs, and modeling_rpt.py names none. Inside rpt (where the
export builds the model before saving it) this stand-in finds that spec through the registry of cells
(`export_spec` of the cell's class), so a family added in its own folder exports without a line here.
"""

import importlib


def Layer(cfg):
    import rpt.models.cells  # noqa: F401 (registers the built-in cells)
    from rpt.models.registry import CELLS

    return importlib.import_module(CELLS[cfg.cell].export_spec).Layer(cfg)
