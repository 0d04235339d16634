"""Every cell's three forms agree: fast path vs reference (outputs, every gradient, initial and final state),
chunked vs whole, step vs parallel; resets really reset; users register gates and cells by name."""

from __future__ import annotations

import pytest
import torch

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models import register_cell, register_gate
from rpt.models.lm import build_cell
from rpt.models.cells.base import Cell
from rpt import kernels

VARIANTS = {
    "lstm": dict(cell="lstm"),
    "lstm-proj": dict(cell="lstm", d_hidden=5),
    "gru": dict(cell="gru"),
    "mingru": dict(cell="mingru"),
    "minlstm": dict(cell="minlstm"),
    "modlstm": dict(cell="modlstm"),
    "modlstm-hard": dict(cell="modlstm", gate="hard_sigmoid"),
    "modlstm-coupled-peep": dict(cell="modlstm", coupled_gates=True, peepholes=True),
    "modlstm-peep-norm": dict(cell="modlstm", peepholes=True, gate_norm=True, d_hidden=5),
    "modlstm-exp": dict(cell="modlstm", gate="exp"),
    "modlstm-exp-norm": dict(cell="modlstm", gate="exp", gate_norm=True),
    "lstm-weightnorm": dict(cell="lstm", weight_norm=True),
    "modlstm-weightnorm": dict(cell="modlstm", weight_norm=True),
    "lstm-heads": dict(cell="lstm", heads=3),
    "gru-heads": dict(cell="gru", heads=2),
    "modlstm-heads-peep": dict(cell="modlstm", heads=3, peepholes=True),
    "modlstm-exp-heads": dict(cell="modlstm", gate="exp", heads=2),
    "mlstm": dict(cell="mlstm", heads=2, chunk_size=4),  # chunks that do not divide the window
    "mlstm-one-head": dict(cell="mlstm", chunk_size=3, d_hidden=9),
    "gdn": dict(cell="gdn", heads=2, chunk_size=4),  # chunks that do not divide the window
    "gdn-one-head": dict(cell="gdn", chunk_size=3, d_hidden=9),
}
D = 6


def make(name: str, seed: int = 0) -> Cell:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=D, **{k: v for k, v in VARIANTS[name].items() if k != "weight_norm"},
                      weight_norm=VARIANTS[name].get("weight_norm", False))
    cell = build_cell(cfg).double()
    with torch.no_grad():  # move every parameter off its special init (zero peepholes, unit norms, ...)
        for p in cell.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return cell


def random_state(cell: Cell, B: int):
    state = [torch.randn(B, *shape, dtype=torch.float64) * 0.5 for shape in cell.state_shapes()]
    if getattr(cell, "exp", False):  # (h, c, n, m): a normaliser > 0 and a stabiliser
        state[2] = torch.rand(B, cell.d_hidden, dtype=torch.float64) + 0.5
        state[3] = torch.randn(B, cell.d_hidden, dtype=torch.float64) * 0.1
    return tuple(s.requires_grad_() for s in state)


def loss_of(y, state, w):
    return (y * w).sum() + sum((k + 1) * 0.3 * s.sum() for k, s in enumerate(state[:2]))


@pytest.mark.parametrize("loop", ["native", "python"])
@pytest.mark.parametrize("name", VARIANTS)
def test_fast_path_matches_reference_with_all_gradients(name, loop):
    """The fused kernels run their time loops in C++ where rpt.kernels.cpu builds them: both forms here."""
    if loop == "python":
        with kernels.use(native=False):
            test_fast_path_matches_reference_with_all_gradients(name, "checked")
        return
    if loop == "native" and kernels.current().loops() is None:
        pytest.skip("the native loops are not built here (test_native_loops says whether they should be)")
    cell = make(name)
    B, T = 3, 9
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    state = random_state(cell, B)
    reset = torch.zeros(T, B, dtype=torch.bool).t()  # a transposed view: the cells may not assume a layout
    reset[0, 4] = reset[2, 1] = True
    w = torch.randn(B, T, D, dtype=torch.float64)
    y_fast, s_fast = cell(x, state, reset)
    y_ref, s_ref = cell.reference(x, state, reset)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-10)
    for a, b in zip(s_fast, s_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    inputs = [x, *[s for s in state if s.requires_grad], *cell.parameters()]
    g_fast = torch.autograd.grad(loss_of(y_fast, s_fast, w), inputs, allow_unused=True)
    g_ref = torch.autograd.grad(loss_of(y_ref, s_ref, w), inputs, allow_unused=True)
    for k, (a, b) in enumerate(zip(g_fast, g_ref)):
        if a is None or b is None:  # e.g. the exp gate's stabiliser state takes no gradient in either form
            assert a is None or not a.abs().any(), k
            assert b is None or not b.abs().any(), k
            continue
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=f"gradient {k} of {name}")


@pytest.mark.parametrize("name", VARIANTS)
def test_chunks_with_carried_state_equal_one_sequence(name):
    cell = make(name)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    y_whole, s_whole = cell(x)
    s, ys = None, []
    for a in range(0, 12, 5):
        y, s = cell(x[:, a:a + 5], s)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_whole)
    for a, b in zip(s, s_whole):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", VARIANTS)
def test_step_by_step_equals_parallel(name):
    cell = make(name)
    x = torch.randn(2, 8, D, dtype=torch.float64)
    y_par, _ = cell(x)
    state = cell.init_state(2)
    for t in range(8):
        y_t, state = cell.step(x[:, t], state)
        torch.testing.assert_close(y_t, y_par[:, t])


@pytest.mark.parametrize("name", VARIANTS)
def test_reset_really_resets(name):
    cell = make(name)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    reset = torch.zeros(2, 10, dtype=torch.bool)
    reset[1, 6] = True
    y, _ = cell(x, random_state(cell, 2), reset)
    y_fresh, _ = cell(x[1:, 6:])  # row 1 from t=6 on must equal a fresh start there
    torch.testing.assert_close(y[1:, 6:], y_fresh)
    y_noreset, _ = cell(x, None)
    assert not torch.allclose(y[1:, 6:], y_noreset[1:, 6:])


def test_flops_count_every_matrix_product():
    for name in ("lstm", "lstm-proj", "gru", "mingru", "minlstm", "modlstm", "modlstm-coupled-peep", "lstm-heads",
                 "gru-heads", "modlstm-heads-peep"):
        cell = make(name)
        matrices = sum(p.numel() for n, p in cell.named_parameters()
                       if p.dim() == 2 and n not in ("peep", "ln_weight", "ln_bias"))  # those act elementwise
        assert cell.flops_per_token() == 2 * matrices, name


@pytest.mark.parametrize("name", ["lstm-heads", "gru-heads", "modlstm-heads-peep", "modlstm-exp-heads"])
def test_heads_equal_the_dense_cell_with_a_block_diagonal_matrix(name):
    """model.heads = k is the dense cell whose recurrent matrix is block-diagonal (k blocks per gate group): the
    same outputs and final state, and the blocks' gradients are the dense matrix's gradient on those blocks."""
    from rpt.ops.stack.spec import block_diagonal

    cell = make(name)
    dense = build_cell(ModelConfig(d_model=D, **{**VARIANTS[name], "heads": 1})).double()
    w = "w_hh" if hasattr(cell, "w_hh") else "w_h"
    groups = getattr(cell, "n_gates", None) or len(cell.groups)
    blocks = getattr(cell, w)
    assert blocks.shape[1] == D // cell.heads
    with torch.no_grad():
        for n, p in dense.named_parameters():
            p.copy_(block_diagonal(blocks, groups, cell.heads) if n == w else dict(cell.named_parameters())[n])
    B, T = 3, 7
    x = torch.randn(B, T, D, dtype=torch.float64)
    state = random_state(cell, B)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[1, 3] = True
    weights = torch.randn(B, T, D, dtype=torch.float64)
    y, s = cell(x, state, reset)
    y_dense, s_dense = dense(x, state, reset)
    torch.testing.assert_close(y, y_dense, rtol=1e-10, atol=1e-12)
    for a, b in zip(s, s_dense):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g_blocks, = torch.autograd.grad(loss_of(y, s, weights), [blocks])
    g_dense, = torch.autograd.grad(loss_of(y_dense, s_dense, weights), [getattr(dense, w)])
    d = D // cell.heads
    on_blocks = g_dense.view(groups, cell.heads, d, cell.heads, d).diagonal(dim1=1, dim2=3)  # [G, d, d, heads]
    torch.testing.assert_close(g_blocks.view(groups, cell.heads, d, d), on_blocks.permute(0, 3, 1, 2))
    assert g_dense.abs().sum() > g_blocks.abs().sum() * 1.01  # the dense matrix's other entries learn too
    with pytest.raises(RptError, match="does not divide"):
        build_cell(ModelConfig(d_model=D, **{**VARIANTS[name], "heads": 4}))


def test_user_registered_gate_in_the_fused_kernel():
    register_gate("softsign01", fn=lambda x: 0.5 + 0.5 * x / (1 + x.abs()), grad=lambda x, y: 0.5 / (1 + x.abs()) ** 2)
    torch.manual_seed(1)
    cell = build_cell(ModelConfig(cell="modlstm", d_model=D, gate="softsign01")).double()
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    y_fast, _ = cell(x)
    y_ref, _ = cell.reference(x)
    torch.testing.assert_close(y_fast, y_ref)
    g_fast = torch.autograd.grad(y_fast.sum(), [x, *cell.parameters()])
    g_ref = torch.autograd.grad(y_ref.sum(), [x, *cell.parameters()])
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b)


class Elman(Cell):
    """A user's cell, as docs/cells.md writes one: a step and no fast path of its own."""

    def __init__(self, d_model, d_hidden=0):
        super().__init__(d_model, d_hidden or d_model)
        self.w = torch.nn.Linear(d_model + self.d_hidden, self.d_hidden)

    def state_sizes(self):
        return [self.d_hidden]

    def step(self, x_t, state):
        h = torch.tanh(self.w(torch.cat([x_t, state[0]], -1)))
        return h, (h,)

    forward = Cell.reference  # no fast path of its own

    def flops_per_token(self):
        return 2 * self.w.weight.numel()


def test_user_registered_cell_builds_by_name():
    register_cell("elman-test")(type("ElmanTest", (Elman,), {}))
    cell = build_cell(ModelConfig(cell="elman-test", d_model=D))
    y, (h,) = cell(torch.randn(2, 4, D))
    assert y.shape == (2, 4, D) and torch.equal(h, y[:, -1])


def test_unknown_cell_and_gate_name_the_fix():
    with pytest.raises(RptError, match="unknown cell 'lsmt'") as info:
        build_cell(ModelConfig(cell="lsmt"))
    assert "lstm" in info.value.fix
    with pytest.raises(RptError, match="unknown gate function"):
        build_cell(ModelConfig(cell="modlstm", gate="tanh2"))
    with pytest.raises(RptError, match="exponential gate"):
        build_cell(ModelConfig(cell="modlstm", gate="exp", coupled_gates=True))


def test_gru_library_path_matches_the_fused_kernel():
    cell = make("gru")
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    reset = torch.zeros(2, 9, dtype=torch.bool)
    reset[1, 3] = True
    state = random_state(cell, 2)
    y_fused, s_fused = cell(x, state, reset)
    from rpt.ops.gru import sequence

    y_lib, s_lib = sequence.library(cell, x, state, reset)  # torch.gru, what runs on GPU
    torch.testing.assert_close(y_fused, y_lib)
    torch.testing.assert_close(s_fused[0], s_lib[0])
    g1 = torch.autograd.grad(y_fused.sum(), [x, *cell.parameters()])
    g2 = torch.autograd.grad(y_lib.sum(), [x, *cell.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_a_cell_gets_the_options_it_declares_and_refuses_the_others():
    """build_cell passes a cell the model options it declares (`options`), by name; an option set for a cell that
    does not take it is refused at start, naming the cells that do."""
    from rpt.errors import RptError
    from rpt.models.registry import check_names

    @register_cell("gated-elman-test")
    class GatedElman(Elman):
        options = ("gate",)

        def __init__(self, d_model, d_hidden=0, gate="sigmoid"):
            super().__init__(d_model, d_hidden)
            self.gate = gate

    cfg = ModelConfig(cell="gated-elman-test", d_model=D, gate="hard_sigmoid")
    check_names(cfg)
    assert build_cell(cfg).gate == "hard_sigmoid"
    with pytest.raises(RptError, match=r"model.peepholes applies to model.cell = 'modlstm'.*'gated-elman-test'"):
        check_names(ModelConfig(cell="gated-elman-test", d_model=D, peepholes=True))
    with pytest.raises(RptError, match=r"model.gate applies to model.cell = 'gated-elman-test' or 'modlstm'"):
        check_names(ModelConfig(cell="lstm", d_model=D, gate="hard_sigmoid"))
    with pytest.raises(RptError, match=r"model.heads applies to model.cell = 'gdn' or 'gru' or 'lstm' or 'mlstm' or 'modlstm'"):
        check_names(ModelConfig(cell="mingru", d_model=D, heads=2))
