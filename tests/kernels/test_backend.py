"""The backend (rpt/kernels/backend.py) picks one form per call, in its order for the device, from what an op
offers and what its fields allow; and the backward runs the form its forward ran, whatever backend is in force
when it runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rpt import kernels
from rpt.config import ModelConfig
from rpt.kernels import Backend, Form
from rpt.models.lm import build_cell
from rpt.ops.modlstm import sequence as modlstm

CPU, GPU = SimpleNamespace(is_cuda=False), SimpleNamespace(is_cuda=True)
EVERY = set(Form)


def test_the_order_and_the_fields():
    native = Backend(ops=object())  # loops "built"
    assert native.form(CPU, EVERY) is Form.LIBRARY
    assert native.form(CPU, {Form.NATIVE_ONE_PASS, Form.NATIVE, Form.ATEN}) is Form.NATIVE_ONE_PASS
    assert Backend(ops=object(), one_pass=False).form(CPU, {Form.NATIVE_ONE_PASS, Form.NATIVE}) is Form.NATIVE
    assert Backend(ops=object(), one_pass=False).form(CPU, {Form.NATIVE_ONE_PASS}) is Form.ATEN
    assert Backend(native=False).form(CPU, {Form.NATIVE_ONE_PASS, Form.NATIVE}) is Form.ATEN
    assert native.form(CPU, {Form.TRITON_LOOP, Form.TRITON_STEPS}) is Form.ATEN  # the Triton forms: a GPU's
    gpu = Backend(ops=object(), triton=False)
    assert gpu.form(GPU, EVERY) is Form.LIBRARY
    assert gpu.form(GPU, {Form.NATIVE_ONE_PASS, Form.NATIVE}) is Form.NATIVE  # one pass is the CPU's
    assert gpu.form(GPU, {Form.NATIVE_ONE_PASS}) is Form.ATEN
    forced = Backend(force=Form.TRITON_STEPS)
    assert forced.form(CPU, {Form.TRITON_STEPS, Form.ATEN}) is Form.TRITON_STEPS
    assert forced.form(CPU, {Form.ATEN}) is Form.ATEN  # only where the op offers it


def test_the_backward_runs_the_form_of_its_forward(monkeypatch):
    """A backend changed between forward and backward (the Python loops for one, the C++ loops for the other)
    changes neither form: the backward of a Python-loop forward runs the Python loops, and the backward of a
    C++-loop forward runs the C++ loops even where the backend in force has none."""
    if kernels.current().loops() is None:
        pytest.skip("no compiler here: the C++ loops are not a form this machine has")
    calls = []
    python_backward = modlstm.backward_steps
    monkeypatch.setattr(modlstm, "backward_steps", lambda *a: calls.append(1) or python_backward(*a))
    torch.manual_seed(0)
    cell = build_cell(ModelConfig(cell="modlstm", d_model=8))
    x = torch.randn(2, 5, 8, requires_grad=True)
    grads = []
    for forward_backend, backward_backend in ((dict(native=False), {}), ({}, dict(native=False))):
        with kernels.use(**forward_backend):
            y, _ = cell(x)
        with kernels.use(**backward_backend):
            grads.append(torch.autograd.grad(y.sum(), x)[0])
    assert calls == [1], "the Python backward ran for the Python forward only"
    torch.testing.assert_close(grads[0], grads[1])
