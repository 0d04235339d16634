"""The wide modlstm's GPU loops (rpt/ops/modlstm/triton_steps.py: a product and one Triton kernel a step) on the
CPU through Triton's interpreter, in float32 (and in float64, as the model tests run them on a GPU), against the
float64 reference of the cell: outputs, final state and every gradient, with resets inside rows, for each gate rpt
ships, a registered gate's Triton form, peepholes, coupled gates, and the gate norm with several heads and with a
width that is not a power of two. On a GPU these loops are replayed as CUDA graphs (rpt/kernels/triton/graphs.py);
here they run as they are."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from rpt.config import ModelConfig  # noqa: E402
from rpt.models import register_gate  # noqa: E402
from rpt.models.lm import build_cell  # noqa: E402
from rpt import kernels  # noqa: E402
from rpt.kernels import Form  # noqa: E402
from rpt.ops.modlstm.sequence import forms  # noqa: E402
from triton_cases import SOFTSIGN, float64_case  # noqa: E402  (SOFTSIGN: a registered gate with its Triton form)


def force_steps(monkeypatch):
    """The step kernels wherever a cell offers them (the GPU's choice), on CPU tensors."""
    monkeypatch.setattr(kernels, "_current", dataclasses.replace(kernels.current(), force=Form.TRITON_STEPS))


VARIANTS = {  # name: (modlstm options, hidden size, heads, units a program takes when the norm is off)
    "sigmoid": (dict(), 24, 1, 256),
    "sigmoid-blocks": (dict(), 40, 1, 16),  # three programs a row, the last one partly masked
    "hard-peep": (dict(gate="hard_sigmoid", peepholes=True), 24, 2, 16),
    "coupled-peep": (dict(coupled_gates=True, peepholes=True), 24, 1, 256),
    "exp": (dict(gate="exp"), 24, 3, 16),
    "norm-heads": (dict(gate_norm=True, peepholes=True), 24, 4, 16),  # the norm across heads: one program a row
    "exp-norm": (dict(gate="exp", gate_norm=True), 20, 1, 256),
    "coupled-norm": (dict(coupled_gates=True, gate_norm=True, gate="hard_sigmoid"), 24, 2, 256),
    "registered": (dict(gate=SOFTSIGN, peepholes=True), 24, 1, 16),
    "float64-exp-norm": (dict(gate="exp", gate_norm=True), 20, 2, 256),  # the dtype the GPU model tests run
    "float64-peep": (dict(peepholes=True), 24, 1, 16),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_modlstm_step_kernels_equal_the_float64_reference(name, monkeypatch):
    from rpt.ops.modlstm import triton_steps as modlstm_steps

    options, H, heads, block = VARIANTS[name]
    force_steps(monkeypatch)  # the GPU's choice, on the CPU
    monkeypatch.setattr(modlstm_steps, "MAX_BLOCK", block)
    torch.manual_seed(0)
    B, T, D = 3, 5, 16
    cell, x, state = float64_case(B, T, d_model=D, d_hidden=H, heads=heads, **options)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 3] = reset[2, 1] = reset[1, 4] = True
    w_y = torch.randn(B, T, D, dtype=torch.float64)
    inputs = [x, *state[:3]]  # m is a constant to differentiation

    def loss(y, s):
        return (y * w_y).sum() + 0.7 * s[0].sum() - 0.4 * s[1].sum() + (0.2 * s[2].sum() if len(s) > 2 else 0)

    for t in inputs:
        t.requires_grad_()
    y_ref, s_ref = cell.reference(x, tuple(state), reset)
    g_ref = torch.autograd.grad(loss(y_ref, s_ref), inputs + list(cell.parameters()), allow_unused=True)

    fast = build_cell(ModelConfig(cell="modlstm", d_model=D, d_hidden=H, heads=heads, **options))
    dtype = torch.float64 if name.startswith("float64") else torch.float32
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    grad_tol = dict(atol=1e-9, rtol=1e-8) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-3)
    fast.to(dtype).load_state_dict(cell.state_dict())
    f_inputs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    s0 = tuple(f_inputs[1:]) + ((state[3].to(dtype),) if cell.exp else ())
    y, s = fast(f_inputs[0], s0, reset)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    for a, b in zip(s, s_ref):
        torch.testing.assert_close(a.double(), b, **tol)
    g = torch.autograd.grad(loss(y, s), f_inputs + list(fast.parameters()), allow_unused=True)
    names = ["x", "h0", "c0", "n0"][:len(inputs)] + [n for n, _ in fast.named_parameters()]
    for n, a, b in zip(names, g, g_ref):
        if b is None:
            assert a is None or not a.abs().any(), n
            continue
        torch.testing.assert_close(a.double(), b, **grad_tol, msg=lambda m: f"gradient of {n}: {m}")


def test_wide_modlstm_cells_take_the_step_kernels_on_a_gpu():
    """The one-kernel loop takes heads of 16-64 units; every other built-in or Triton-formed gate takes the step
    kernels on a GPU (a CPU tensor never does); a registered gate without a Triton form takes neither."""
    def form(x, d_model=128, **kw):  # 128 units: more than the one-kernel loop takes
        cell = build_cell(ModelConfig(cell="modlstm", d_model=d_model, **kw))
        return kernels.current().form(x, forms(cell.variant, cell.d_hidden, cell.heads, x.is_cuda))

    assert form(torch.empty(0)) is Form.NATIVE_ONE_PASS or kernels.current().loops() is None
    gpu = SimpleNamespace(is_cuda=True)  # what the backend asks of x
    assert form(gpu, gate="exp") is form(gpu, gate_norm=True) is form(gpu, gate=SOFTSIGN) is Form.TRITON_STEPS
    assert form(gpu, d_model=32, heads=2) is Form.TRITON_LOOP
    register_gate("softsign-steps-no-triton", lambda x: 0.5 + 0.5 * x / (1 + x.abs()),
                  lambda x, y: 0.5 / (1 + x.abs()) ** 2)
    with pytest.warns(UserWarning, match="has no Triton form"):
        assert form(gpu, gate="softsign-steps-no-triton") is Form.ATEN


class ReplayedGraph:
    """What a CUDA graph does, on the CPU: replay reruns the captured loop on the same static tensors and leaves
    its results in the memory the capture returned (a real graph's kernels write the same addresses again)."""

    def __init__(self, loop, flags, static_in, static_out, results):
        self.loop = (loop, flags, static_in, static_out, results)

    def replay(self):
        loop, flags, static_in, static_out, results = self.loop
        for kept, new in zip(results, loop(flags, static_in, static_out)):
            if kept is not None:
                kept.copy_(new)


def test_graph_replays_copy_inputs_in_and_outputs_out(monkeypatch):
    """rpt.kernels.triton.graphs.replay's protocol around a graph (static inputs copied in, outputs and results
    copied out, nothing aliased to the graph's tensors), through the modlstm's loops: two calls with different
    inputs through one captured graph each give what the uncaptured loops give."""
    from rpt.kernels.triton import graphs

    captures = []

    def capture(loop, flags, inputs, outputs):  # graphs._capture with the capture itself replaced by a record
        static_in = [t.clone() if t is not None else None for t in inputs]
        static_out = [torch.empty_like(t) if t is not None else None for t in outputs]
        results = loop(flags, static_in, static_out)
        captures.append(loop.__name__)
        return ReplayedGraph(loop, flags, static_in, static_out, results), static_in, static_out, results

    force_steps(monkeypatch)
    cell = build_cell(ModelConfig(cell="modlstm", d_model=16, d_hidden=20, gate="exp", gate_norm=True))
    reset = torch.zeros(2, 4, dtype=torch.bool)
    reset[1, 2] = True
    runs = {}
    for captured in (False, True):
        if captured:
            monkeypatch.setattr(graphs, "uncaptured", lambda t: False)
            monkeypatch.setattr(graphs, "_capture", capture)
            graphs.clear()
        for seed in (0, 1):
            torch.manual_seed(seed)
            x = torch.randn(2, 4, 16, requires_grad=True)
            y, state = cell(x, None, reset)
            grads = torch.autograd.grad((y * torch.randn_like(y)).sum() + state[1].sum(), [x, *cell.parameters()])
            runs[captured, seed] = [y, *state, *grads]
    assert sorted(captures) == ["_backward_loop", "_forward_loop"]  # one capture each, two replays
    for seed in (0, 1):
        for a, b in zip(runs[True, seed], runs[False, seed]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(runs[True, 0][0], runs[True, 1][0])
