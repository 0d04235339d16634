"""The matrix memories' windows (mlstm, gdn) go through the backend (rpt.kernels): on the CPU it picks their
chunkwise form, and forced to the ATen form it runs the spec one token at a time; the two equal in float64
through the dispatch, resets inside the window included. (Each form against the steps, gradients and chunk sizes
included: tests/ops/FAMILY/.)"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from rpt import kernels
from rpt.kernels.backend import Form

B, H, T, D = 2, 3, 11, 4


def window(family: str):
    """The op's inputs over a window of T (q, k, v, two gates [B, H, T]) and an entering state, float64."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, v = r(B, H, T, D), r(B, H, T, D)
    if family == "gdn":
        k = F.normalize(r(B, H, T, D), dim=-1)
        return [q, k, v, -F.softplus(r(B, H, T)), torch.sigmoid(r(B, H, T))], r(B, H, D, D)
    return [q, r(B, H, T, D), v, r(B, H, T), F.logsigmoid(r(B, H, T))], (r(B, H, D, D), r(B, H, D), r(B, H))


@pytest.mark.parametrize("family", ["mlstm", "gdn"])
def test_the_backend_runs_the_chunkwise_form_on_the_cpu_and_the_steps_when_forced(family, monkeypatch):
    sequence = importlib.import_module(f"rpt.ops.{family}.sequence")
    ran = []
    for form in ("chunkwise", "steps"):
        monkeypatch.setattr(sequence, form, lambda *a, _f=getattr(sequence, form), _n=form: ran.append(_n) or _f(*a))
    xs, state = window(family)
    assert kernels.current().form(xs[0], sequence.forms(xs[0])) is Form.CHUNKWISE
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 0] = reset[0, 4] = reset[0, 5] = reset[1, 7] = True  # at the start, twice in a row, mid-window
    chunked = sequence.forward(*xs, reset, state, 4)
    with kernels.use(force=Form.ATEN):
        stepped = sequence.forward(*xs, reset, state, 4)
    assert ran == ["chunkwise", "steps"]
    for a, b in zip(torch.utils._pytree.tree_leaves(chunked), torch.utils._pytree.tree_leaves(stepped)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
