"""The Triton modlstm loop (rpt/ops/modlstm/triton.py) on the CPU through Triton's interpreter, in float32,
against the float64 reference of the head-wise modlstm cell, for every gate rpt ships and the gate layer norm,
peepholes and coupled gates: outputs, final state, and every gradient (x, W_x, the recurrent blocks, the bias or
the layer norm's scale and shift, the peepholes, the initial state), with resets inside rows."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from rpt.config import ModelConfig  # noqa: E402
from rpt.kernels import Form  # noqa: E402
from rpt.models import register_gate  # noqa: E402
from rpt.models.lm import build_cell  # noqa: E402
from rpt.ops.modlstm.sequence import forms  # noqa: E402
from triton_cases import SOFTSIGN, float64_case  # noqa: E402  (SOFTSIGN: a registered gate with its Triton form)


VARIANTS = {  # name: (modlstm options, heads, a head's width)
    "sigmoid": (dict(), 2, 16),
    "hard-peep": (dict(gate="hard_sigmoid", peepholes=True), 2, 16),
    "coupled-peep": (dict(coupled_gates=True, peepholes=True), 3, 16),
    "exp": (dict(gate="exp"), 2, 16),
    "norm-peep": (dict(gate_norm=True, peepholes=True), 1, 16),  # the gate norm spans a group's H units: one head
    "exp-norm": (dict(gate="exp", gate_norm=True), 1, 32),
    "coupled-norm": (dict(coupled_gates=True, gate_norm=True, gate="hard_sigmoid"), 1, 16),
    "peep-width-24": (dict(peepholes=True), 2, 24),  # padded to 32 on chip, the padding masked
    "exp-width-20": (dict(gate="exp"), 1, 20),
    "registered-peep": (dict(gate=SOFTSIGN, peepholes=True), 2, 16),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_modlstm_loop_equals_the_float64_reference(name):
    from rpt.ops.modlstm.triton import modlstm_triton_loop

    options, heads, width = VARIANTS[name]
    torch.manual_seed(0)
    D = H = width * heads
    B, T = 5, 6
    cell, x, state = float64_case(B, T, d_model=D, heads=heads, **options)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 3] = reset[4, 1] = True
    w_y = torch.randn(B, T, H, dtype=torch.float64)
    inputs = [x, *state[:3]]
    params = {n: p for n, p in cell.named_parameters()}

    def loss(y, s):
        return (y * w_y).sum() + 0.7 * s[0].sum() - 0.4 * s[1].sum() + (0.2 * s[2].sum() if len(s) > 2 else 0)

    for t in inputs:
        t.requires_grad_()
    y_ref, s_ref = cell.reference(x, tuple(state), reset)
    names = ["x", "h0", "c0", "n0"][:len(inputs)] + list(params)
    g_ref = torch.autograd.grad(loss(y_ref, s_ref), inputs + list(params.values()), allow_unused=True)
    f32 = [t.detach().float().requires_grad_() for t in inputs + list(params.values())]
    xf, rest = f32[0], f32[1:len(inputs)]
    p32 = dict(zip(params, f32[len(inputs):]))
    keep = (~reset).float().t().contiguous()
    s0 = tuple(rest) + ((state[3].float(),) if cell.exp else ())
    y, s = modlstm_triton_loop(xf, p32["w_x"], p32["w_h"], p32.get("bias"), p32.get("ln_weight"), p32.get("ln_bias"),
                            p32.get("peep"), s0, keep, cell.gate, cell.coupled, heads)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-5, rtol=1e-4)
    for a, b in zip(s, s_ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)
    g = torch.autograd.grad(loss(y, s), f32, allow_unused=True)
    for name, a, b in zip(names, g, g_ref):
        if b is None:
            assert a is None or not a.abs().any(), name
            continue
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3, msg=lambda m: f"gradient of {name}: {m}")


def test_which_modlstm_cells_the_triton_loop_takes():
    """On a GPU: heads of 16-64 units with a built-in gate or a registered one with its Triton form; the gate norm
    with one head only; a registered gate without a Triton form takes the step loop, and says what that costs."""
    def takes(**kw):
        cell = build_cell(ModelConfig(cell="modlstm", **kw))
        return Form.TRITON_LOOP in forms(cell.variant, cell.d_hidden, cell.heads, on_gpu=True)

    assert takes(d_model=64, heads=4) and takes(d_model=64, heads=2, gate="exp") and takes(d_model=32, gate_norm=True)
    assert takes(d_model=96, heads=2) and not takes(d_model=96, heads=8)  # heads of 48 units (padded), of 12
    assert not takes(d_model=64, heads=4, gate_norm=True) and not takes(d_model=128)  # 128 units in one program
    assert not takes(d_model=48, gate_norm=True)  # the norm's statistics are not masked
    assert takes(d_model=64, heads=4, gate=SOFTSIGN)
    register_gate("softsign-gate-test", lambda x: 0.5 + 0.5 * x / (1 + x.abs()),
                  lambda x, y: 0.5 / (1 + x.abs()) ** 2)
    with pytest.warns(UserWarning, match="has no Triton form"):
        assert not takes(d_model=64, heads=4, gate="softsign-gate-test")
