"""The built-in cells; importing this package registers them."""

from rpt.models.cells import gru, lstm, minrnn, modlstm  # noqa: F401
from rpt.models.cells.base import Cell, State

__all__ = ["Cell", "State"]
