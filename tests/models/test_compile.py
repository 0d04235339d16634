"""torch.compile of a model, for every cell: the traced model computes what the eager one does.

Tracing runs each op on tensors without data, so the native ops (rpt.models.cells.native) need shape rules:
compiling a mingru or minlstm model failed on the CPU before the min scan had them. gru's and modlstm's fused
kernels are torch custom operators with shape rules (before, as autograd.Functions around oneDNN's packed
weights, they broke the graph). Every cell traces as one graph. aot_eager traces forward and backward as torch.compile does, without generating
code (inductor was checked by hand: the same results, about a minute per model).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.lm import build_cell
from rpt import kernels


CELLS = {
    "lstm": dict(cell="lstm"),
    "gru": dict(cell="gru"),
    "modlstm": dict(cell="modlstm"),
    "modlstm-exp-norm": dict(cell="modlstm", gate="exp", gate_norm=True),
    "modlstm-coupled-peep-hard": dict(cell="modlstm", coupled_gates=True, peepholes=True, gate="hard_sigmoid"),
    "mingru": dict(cell="mingru"),
    "minlstm": dict(cell="minlstm"),
    "hybrid": dict(cell="modlstm", attention_every=2, attention_window=8, mlp_ratio=2),  # attention's state carried
}


@pytest.mark.parametrize("name", CELLS)
def test_compiled_model_matches_eager_with_gradients(name):
    """One graph (fullgraph) for every cell whose kernel takes the reset mask, with a reset inside the sequence and
    a carried state whose gradient is checked too. lstm runs torch's LSTM between the reset columns, a cut that
    depends on the mask's values: its graph breaks there (test below)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, **CELLS[name]))
    tokens = torch.randint(0, 64, (2, 16))
    reset = torch.zeros(2, 16, dtype=torch.bool)
    reset[1, 5] = True
    with torch.no_grad():
        carried = model(tokens)[1]  # a state from an earlier chunk, as in truncated BPTT

    def outputs_and_grads(m):
        model.zero_grad()
        state = torch.utils._pytree.tree_map(lambda t: t.clone().requires_grad_(t.is_floating_point()), carried)
        logits, new_state = m(tokens, state, reset)
        leaves = [t for t in torch.utils._pytree.tree_leaves(new_state) if t.requires_grad]
        (logits.square().sum() + sum(t.square().sum() for t in leaves)).backward()
        state_grads = [t.grad for t in torch.utils._pytree.tree_leaves(state) if t.grad is not None]
        return [logits.detach(), *(p.grad.clone() for p in model.parameters()), *state_grads]

    eager = outputs_and_grads(model)
    if CELLS[name]["cell"] in ("gru", "modlstm", "mingru", "minlstm") and shutil.which("g++"):
        assert kernels.current().loops() is not None, "the native loops did not build: this would test the Python loops"
    whole = CELLS[name]["cell"] != "lstm"
    compiled = outputs_and_grads(torch.compile(model, backend="aot_eager", fullgraph=whole))
    assert len(compiled) == len(eager) > len(list(model.parameters())) + 1  # the state's gradients are compared
    for k, (a, b) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"tensor {k}")


def test_a_compiled_lstm_reads_each_reset_mask():
    """lstm cuts its sequence at the columns where a row resets, and remembers the last mask's columns (a GPU
    reads them with a host sync). A compiled model must not take remembered columns as constants of its graph: it
    did, and ran a new mask with the old cut (0.33 off in the logits)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="lstm", vocab_size=64, d_model=32, n_layers=2))
    tokens = torch.randint(0, 64, (2, 16))
    masks = [torch.zeros(2, 16, dtype=torch.bool) for _ in range(3)]
    masks[0][1, 5] = masks[1][0, 9] = masks[2][1, 12] = True
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        model(tokens, None, masks[0])  # remembered by the eager call
        for mask in masks:
            torch.testing.assert_close(compiled(tokens, None, mask)[0], model(tokens, None, mask)[0])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch's CPU LSTM kernel is oneDNN's")
def test_a_compiled_lstm_keeps_torchs_kernel():
    """Traced for training, torch's LSTM turns into per-step products (the shakespeare model's step took twice as
    long); inside a compiled model the cell runs oneDNN's kernel, as eagerly."""
    torch._dynamo.reset()
    model = RecurrentLM(ModelConfig(cell="lstm", vocab_size=64, d_model=32, n_layers=2))
    compiled = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, 64, (2, 16))
    compiled(tokens)[0].sum().backward()  # compiled before profiling
    with torch.profiler.profile() as prof:
        compiled(tokens)[0].sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "aten::mkldnn_rnn_layer" in names and "aten::mkldnn_rnn_layer_backward" in names


@pytest.mark.parametrize("name", ["gru", "modlstm", "modlstm-exp-norm", "modlstm-coupled-peep-hard"])
def test_fused_kernels_are_well_formed_custom_operators(name):
    """torch.library.opcheck of gru's and modlstm's operators, forward and backward: their schema (no input
    mutated, no output aliasing an input or another output), the gradient registration, and the shape rules
    against the kernels, strides included (inductor asserts those when it runs; aot_eager does not)."""
    from rpt.ops.gru import sequence as gru
    from rpt.ops.gru.sequence import gru_sequence, gru_sequence_backward
    from rpt.ops.modlstm import sequence as modlstm
    from rpt.ops.modlstm.sequence import _some, modlstm_sequence, modlstm_sequence_backward

    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=8, **CELLS[name]))
    B, T = 2, 5
    x = torch.randn(B, T, 8, requires_grad=True)
    keep = torch.ones(T, B)
    keep[3, 1] = 0
    state = [torch.randn(B, *shape) for shape in cell.state_shapes()]
    if name == "gru":
        form = kernels.current().form(x, gru.forms(cell.d_hidden, cell.heads, on_gpu=False)).value
        args = (x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, state[0], keep, form)
        with torch.no_grad():  # the backward's inputs: what the forward saved, no graph behind them
            y, h, *buffers = gru_sequence(*args)
        grad_args = (torch.randn_like(y), torch.randn_like(h), x.detach(), cell.w_ih.detach(), cell.w_hh.detach(),
                     state[0], keep, *buffers, form)
        forward, backward = gru_sequence, gru_sequence_backward
    else:
        n0, m0 = (state[2].abs() + 0.5, state[3] * 0.1) if cell.exp else (None, None)
        form = kernels.current().form(x, modlstm.forms(cell.variant, cell.d_hidden, cell.heads, on_gpu=False)).value
        detached = [p.detach() if p is not None else None for p in (cell.w_x, cell.w_h, cell.ln_weight, cell.peep)]
        args = (x, cell.w_x, cell.w_h, cell.bias, cell.ln_weight, cell.ln_bias, cell.peep, state[0], state[1], n0, m0,
                keep, cell.gate, cell.coupled, form)
        with torch.no_grad():
            y, h, c, n, m, acts, pre, cs, hs, ns, ln_in, ln_stats = modlstm_sequence(*args)
        grad_args = (torch.randn_like(y), torch.randn_like(h), torch.randn_like(c),
                     torch.randn_like(n) if cell.exp else None, x.detach(), *detached[:3], detached[3], state[0],
                     state[1], n0, keep, acts, _some(pre), cs, hs, _some(ns), _some(ln_in), _some(ln_stats),
                     cell.gate, cell.coupled, cell.bias is not None, form)
        forward, backward = modlstm_sequence, modlstm_sequence_backward
    for op, op_args in ((forward, args), (backward, grad_args)):
        torch.library.opcheck(op, op_args)  # raises on a failed check
