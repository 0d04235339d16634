"""modlstm's gate functions by name: the spec's built-in ones and those a user registers (rpt.models.register_gate).

A gate is a pair of torch functions, its value and its derivative, which the fused kernel's hand-written backward
reads; the op looks a gate up by name because a torch custom operator takes its name, not the function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rpt.errors import RptError, did_you_mean
from rpt.kernels.triton import GATE_FORMS
from rpt.ops.modlstm.spec import GATES as BUILT_IN_GATES

GATES: dict[str, "GateFunction"] = {}


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
# as well as or better than the sigmoid gate (benchmarks/results/cells.md). At -1 the state keeps 1/e of its past
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
        raise RptError(f"unknown gate function '{name}'", did_you_mean(name, ["exp", *GATES]) +
                       f"model.gate must be one of exp, {', '.join(sorted(GATES))}, or a gate of your own registered "
                       "with register_gate in a module named in model.imports (docs/cells.md)")
    return GATES[name]


for _name, (_fn, _grad) in BUILT_IN_GATES.items():  # the spec's (rpt/ops/modlstm/spec.py), which export ships
    register_gate(_name, _fn, _grad)
