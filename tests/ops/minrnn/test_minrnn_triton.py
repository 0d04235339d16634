"""minGRU's and minLSTM's Triton scan (rpt/ops/minrnn/triton.py) on the CPU through Triton's interpreter,
against the cells' float64 reference loops: outputs, final state, and the gradients of x, every parameter and the
initial state, with resets inside rows, at lengths that are and are not a multiple of the kernel's time tile and
widths that are not a multiple of its unit block; and in bfloat16, u read in the autocast dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from rpt.config import ModelConfig  # noqa: E402
from rpt.models.lm import build_cell  # noqa: E402
from rpt import kernels  # noqa: E402
from rpt.kernels import Form  # noqa: E402


def gpu_path(monkeypatch):
    """The cell's GPU branch on CPU tensors; returns the kinds the Triton scan was called with."""
    from rpt.ops.minrnn import triton as min_scan

    calls, scan = [], min_scan.min_scan

    def counted(u, h0, keep, kind):
        calls.append(kind)
        return scan(u, h0, keep, kind)

    monkeypatch.setattr(kernels, "_current", dataclasses.replace(kernels.current(), force=Form.TRITON_LOOP))
    monkeypatch.setattr(min_scan, "min_scan", counted)
    return calls


@pytest.mark.parametrize("cell_name, T, H, dtype", [
    ("mingru", 37, 24, torch.float32), ("minlstm", 32, 70, torch.float32), ("mingru", 5, 64, torch.float32),
    ("minlstm", 21, 24, torch.float64)])  # float64: as the model tests run it on a GPU
def test_triton_min_scan_equals_the_float64_reference(cell_name, T, H, dtype, monkeypatch):
    torch.manual_seed(0)
    B, D = 3, 12
    cell = build_cell(ModelConfig(cell=cell_name, d_model=D, d_hidden=H)).double()
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(B, H, dtype=torch.float64)).requires_grad_()
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, min(3, T - 1)] = reset[2, T // 2] = reset[1, 0] = True
    w = torch.randn(B, T, D, dtype=torch.float64)
    y_ref, (h_ref,) = cell.reference(x, (h0,), reset)
    params = list(cell.parameters())
    g_ref = torch.autograd.grad((y_ref * w).sum() + 0.3 * h_ref.sum(), [x, h0, *params])

    fast = build_cell(ModelConfig(cell=cell_name, d_model=D, d_hidden=H)).to(dtype)
    fast.load_state_dict(cell.state_dict())
    xf, h0f = x.detach().to(dtype).requires_grad_(), h0.detach().to(dtype).requires_grad_()
    from rpt.ops.minrnn.triton import MINGRU, MINLSTM

    calls = gpu_path(monkeypatch)
    y, (h,) = fast(xf, (h0f,), reset)
    g = torch.autograd.grad((y * w.to(dtype)).sum() + 0.3 * h.sum(), [xf, h0f, *fast.parameters()])
    monkeypatch.undo()
    assert calls == [MINGRU if cell_name == "mingru" else MINLSTM]  # the Triton scan ran, with the cell's kind
    exact = dtype == torch.float64
    tol = dict(atol=1e-10, rtol=1e-9) if exact else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(h.double(), h_ref, **tol)
    tol = dict(atol=1e-9, rtol=1e-8) if exact else dict(atol=1e-4, rtol=1e-3)
    for k, (a, b) in enumerate(zip(g, g_ref)):
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m: f"gradient {k}: {m}")


def test_triton_min_scan_reads_bfloat16_and_returns_its_gradient_in_it(monkeypatch):
    from rpt.ops.minrnn.triton import MINLSTM, min_scan

    torch.manual_seed(1)
    B, T, H = 2, 20, 16
    u = torch.randn(B, T, 3 * H).bfloat16().requires_grad_()
    h0 = torch.randn(B, H)
    h = min_scan(u, h0, None, MINLSTM)
    f, i, h_tilde = u.detach().double().chunk(3, dim=-1)
    f, i = torch.sigmoid(f), torch.sigmoid(i)
    a, b = f / (f + i), i / (f + i) * h_tilde
    expected, state = [], h0.double()
    for t in range(T):
        state = a[:, t] * state + b[:, t]
        expected.append(state)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h.double(), torch.stack(expected, 1), atol=1e-5, rtol=1e-5)  # fp32 inside
    (du,) = torch.autograd.grad(h.sum(), u)
    assert du.dtype == torch.bfloat16 and du.shape == u.shape and du.abs().sum() > 0


def test_torch_compile_traces_the_triton_scan_in_one_graph():
    """The scan is a custom operator with fake forms: torch.compile traces through it without a graph break
    (fullgraph), and the compiled function's outputs and gradients are the eager ones."""
    from rpt.ops.minrnn.triton import MINGRU, min_scan

    torch.manual_seed(0)
    u = torch.randn(2, 19, 2 * 20, requires_grad=True)
    h0 = torch.randn(2, 20, requires_grad=True)
    keep = torch.ones(2, 19)
    keep[1, 7] = 0.0

    def run(u, h0):
        return min_scan(u, h0, keep, MINGRU).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    eager, traced = run(u, h0), compiled(u, h0)
    torch.testing.assert_close(traced, eager)
    for a, b in zip(torch.autograd.grad(traced, [u, h0]), torch.autograd.grad(eager, [u, h0])):
        torch.testing.assert_close(a, b)
