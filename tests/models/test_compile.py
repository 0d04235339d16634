"""torch.compile of a model, for every cell: the traced model computes what the eager one does.

Tracing runs each op on tensors without data, so the native ops (rpt.models.cells.native) need shape rules:
compiling a mingru or minlstm model failed on the CPU before the min scan had them, and with them the scan
cells trace as one graph. aot_eager traces forward and backward as torch.compile does, without generating
code (inductor was checked by hand: the same results, about a minute per model).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.cells import native


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm", "mingru", "minlstm"])
def test_compiled_model_matches_eager_with_gradients(cell):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, vocab_size=64, d_model=32, n_layers=2))
    tokens = torch.randint(0, 64, (2, 16))

    def outputs_and_grads(m):
        model.zero_grad()
        logits, state = m(tokens)
        (logits.square().sum()).backward()
        return [logits.detach(), *(p.grad.clone() for p in model.parameters())]

    eager = outputs_and_grads(model)
    if cell in ("gru", "modlstm", "mingru", "minlstm") and shutil.which("g++"):
        assert native.loops() is not None, "the native loops did not build: this would test the Python loops"
    # One graph for the scan cells (their native ops have shape rules); gru's and modlstm's kernels break it.
    whole = cell in ("lstm", "mingru", "minlstm")
    compiled = outputs_and_grads(torch.compile(model, backend="aot_eager", fullgraph=whole))
    for k, (a, b) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"tensor {k}")
