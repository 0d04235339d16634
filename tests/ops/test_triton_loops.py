"""The Triton lstm and gru loops (rpt/ops/lstm/triton.py, gru.py) on the CPU through Triton's interpreter, in
float32, against the float64 reference of the head-wise cell: outputs, final state, and every gradient (x, W_ih,
the recurrent blocks, both biases, the initial state), with resets inside rows and a batch that does not fill a
program."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rpt.config import ModelConfig
from rpt.models.lm import build_cell


def reference_and_kernel(cell_name: str, heads: int, B: int, T: int, resets: bool, width: int = 16):
    from rpt.ops.gru.triton import gru_triton_loop
    from rpt.ops.lstm.triton import lstm_triton_loop

    torch.manual_seed(0)
    D = H = width * heads  # no projection: the loop's output is the cell's
    cell = build_cell(ModelConfig(cell=cell_name, d_model=D, d_hidden=H, heads=heads)).double()
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(B, T, D, dtype=torch.float64)
    state = tuple(torch.randn(B, *shape, dtype=torch.float64) * 0.5 for shape in cell.state_shapes())
    reset = torch.zeros(B, T, dtype=torch.bool)
    if resets:
        reset[0, 3] = reset[B - 1, 1] = True
    w_y = torch.randn(B, T, H, dtype=torch.float64)
    weights = [cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh]

    def loss(y, s):
        return (y * w_y).sum() + 0.7 * s[0].sum() - (0.4 * s[1].sum() if len(s) > 1 else 0)

    inputs = [x, *state]
    for t in inputs:
        t.requires_grad_()
    y_ref, s_ref = cell.reference(x, state, reset)
    g_ref = torch.autograd.grad(loss(y_ref, s_ref), inputs + weights)
    f32 = [t.detach().float().requires_grad_() for t in inputs + weights]
    xf, *s0 = f32[:len(inputs)]
    w_ih, w_hh, b_ih, b_hh = f32[len(inputs):]
    keep = (~reset).float().t().contiguous() if resets else None
    if cell_name == "lstm":
        y, s = lstm_triton_loop(xf, w_ih, w_hh, b_ih, b_hh, *s0, keep, heads)
    else:
        y, s = gru_triton_loop(xf, w_ih, w_hh, b_ih, b_hh, *s0, keep, heads)
    g = torch.autograd.grad(loss(y, s), f32)
    return (y_ref, s_ref, g_ref), (y, s, g)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("heads,B,T,resets,width", [(2, 3, 7, True, 16), (1, 18, 4, False, 16), (3, 5, 5, True, 16),
                                                    (2, 3, 4, True, 24)])  # 24 units: padded to 32, masked
def test_triton_loop_equals_the_float64_reference(cell, heads, B, T, resets, width):
    (y_ref, s_ref, g_ref), (y, s, g) = reference_and_kernel(cell, heads, B, T, resets, width)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-6, rtol=1e-5)
    for a, b in zip(s, s_ref):
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=1e-5)
    names = ["x", "h0", "c0"][:1 + len(s)] + ["w_ih", "w_hh", "b_ih", "b_hh"]
    for name, a, b in zip(names, g, g_ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm-exp", "modlstm-peep"])
def test_torch_compile_traces_each_triton_loop_in_one_graph(cell):
    """The loops are custom operators with fake forms: torch.compile traces through them without a graph break
    (fullgraph), and the compiled function's outputs and gradients are the eager ones."""
    from rpt.ops.gru.triton import gru_triton_loop
    from rpt.ops.lstm.triton import lstm_triton_loop
    from rpt.ops.modlstm.triton import modlstm_triton_loop

    torch.manual_seed(0)
    heads, H, B, T = 2, 32, 3, 4
    name, _, variant = cell.partition("-")
    options = {"exp": dict(gate="exp"), "peep": dict(peepholes=True, gate="hard_sigmoid")}.get(variant, {})
    module = build_cell(ModelConfig(cell=name, d_model=H, heads=heads, **options))
    x = torch.randn(B, T, H, requires_grad=True)
    state = module.init_state(B)
    keep = torch.ones(T, B)
    keep[2, 1] = 0.0

    def run(x):
        if name == "lstm":
            y, s = lstm_triton_loop(x, module.w_ih, module.w_hh, module.b_ih, module.b_hh, *state, keep, heads)
        elif name == "gru":
            y, s = gru_triton_loop(x, module.w_ih, module.w_hh, module.b_ih, module.b_hh, *state, keep, heads)
        else:
            y, s = modlstm_triton_loop(x, module.w_x, module.w_h, module.bias, None, None, module.peep, state, keep,
                                    module.gate, False, heads)
        return y.square().sum() + s[0].sum()

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    params = [p for p in module.parameters()]
    eager, compiled_loss = run(x), compiled(x)
    torch.testing.assert_close(compiled_loss, eager)
    g_eager = torch.autograd.grad(eager, [x, *params])
    g_compiled = torch.autograd.grad(compiled_loss, [x, *params])
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm"])
def test_triton_loops_read_bfloat16_pre_activations_and_keep_float32_state(cell):
    """Under autocast the input projection hands the loops bf16 pre-activations: the loop reads them into its
    float32 state and products, so it gives exactly what it gives for the same values in float32, and returns
    their gradient in bf16 (the same values rounded)."""
    from rpt.ops.gru.triton import gru_loop
    from rpt.ops.lstm.triton import lstm_loop
    from rpt.ops.modlstm.triton import modlstm_loop

    torch.manual_seed(0)
    heads, d, B, T = 2, 16, 3, 5
    G = {"lstm": 4, "gru": 3, "modlstm": 4}[cell]
    r = 0.3 * torch.randn(G, heads, d, d)
    h0, c0 = torch.randn(B, heads * d), torch.randn(B, heads * d)
    keep = torch.ones(T, B)
    keep[2, 1] = 0.0

    def run(gx):
        if cell == "lstm":
            return lstm_loop(gx, r, h0, c0, keep)[0]
        if cell == "gru":
            return gru_loop(gx, r, torch.zeros(heads * d), h0, keep)[0]
        return modlstm_loop(gx, r, None, None, None, h0, c0, None, None, keep, "sigmoid", False)[0]

    gx = torch.randn(T, B, G * heads * d).bfloat16()
    outputs, grads = [], []
    for inputs in (gx.clone(), gx.float()):
        inputs.requires_grad_()
        hs = run(inputs)
        (grad,) = torch.autograd.grad((hs * torch.linspace(-1, 1, hs.numel()).view_as(hs)).sum(), inputs)
        outputs.append(hs)
        grads.append(grad)
    assert outputs[0].dtype == torch.float32 and torch.equal(outputs[0], outputs[1])
    assert grads[0].dtype == torch.bfloat16 and torch.equal(grads[0], grads[1].bfloat16())
