"""The products of rpt/kernels/cpu/products.py (oneDNN's; rpt's small-batch one) against float64.

`linear` takes the oneDNN path only for large float32 CPU products, which the float64 parity tests of the
cells never reach: here it is checked on its own, output and every gradient, and its fallbacks are checked to
be F.linear itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rpt.models  # noqa: F401  (registers the loops' check)
from rpt import kernels
from rpt.kernels.cpu import products
from rpt.kernels.cpu.products import MIN_ROWS, linear


def grads_of(fn, x, w, b, gy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], gy)
    return [y, *grads]


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_float64_with_every_gradient(bias):
    if not products._packed_available():
        pytest.skip("torch has no oneDNN linear here")
    torch.manual_seed(0)
    x = torch.randn(4, MIN_ROWS // 4 + 3, 48)  # a 3-D input of more than MIN_ROWS rows
    w, b = torch.randn(40, 48) * 0.2, (torch.randn(40) if bias else None)
    gy = torch.randn(4, MIN_ROWS // 4 + 3, 40)
    calls = []
    real = products._OneDNNLinear.apply
    products._OneDNNLinear.apply = lambda *a: calls.append(1) or real(*a)
    try:
        got = grads_of(linear, x, w, b, gy)
    finally:
        products._OneDNNLinear.apply = real
    assert calls, "the oneDNN path did not run"
    exact = grads_of(F.linear, x.double(), w.double(), b.double() if bias else None, gy.double())
    plain = grads_of(F.linear, x, w, b, gy)
    assert len(got) == len(exact) == len(plain) == (4 if bias else 3)
    for k, (a, p, ref) in enumerate(zip(got, plain, exact)):
        assert a.shape == ref.shape and a.dtype == torch.float32, k
        scale = ref.abs().max().item()
        e_onednn, e_plain = ((a - ref).abs().max() / scale).item(), ((p - ref).abs().max() / scale).item()
        assert e_onednn <= 3 * e_plain + 1e-6, f"output {k}: oneDNN {e_onednn:.2e}, F.linear {e_plain:.2e}"


def test_small_other_dtype_and_autocast_calls_are_f_linear(monkeypatch):
    def refuse(*args):
        raise AssertionError("the oneDNN path ran")
    monkeypatch.setattr(products._OneDNNLinear, "apply", refuse)
    w = torch.randn(8, 16)
    few = torch.randn(2, 5, 16)  # generation-sized: F.linear
    torch.testing.assert_close(linear(few, w), F.linear(few, w), rtol=0, atol=0)
    many64 = torch.randn(MIN_ROWS, 16, dtype=torch.float64)
    torch.testing.assert_close(linear(many64, w.double()), F.linear(many64, w.double()), rtol=0, atol=0)
    many = torch.randn(MIN_ROWS, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(many, w).dtype == torch.bfloat16  # autocast's own cast, as F.linear


@pytest.mark.parametrize("name", ["gru", "modlstm"])
def test_fused_cells_sequence_products_on_onednn_as_accurate_as_mkl(name, monkeypatch):
    """gru's and modlstm's own kernels call `matmul` for their sequence-sized products (the input projection and
    its input gradient): at more than MIN_ROWS rows of float32 these run on oneDNN, and the whole layer's output
    and gradients stay as close to float64 as with torch's default GEMM."""
    if not products._packed_available():
        pytest.skip("torch has no oneDNN linear here")
    from rpt.config import ModelConfig
    from rpt.models.lm import build_cell

    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=24, cell=name))
    x = torch.randn(2, MIN_ROWS // 2 + 5, 24)
    gy = torch.randn(2, MIN_ROWS // 2 + 5, 24)

    def run(module, xs, g):
        xs = xs.clone().requires_grad_()
        y, _ = module(xs)
        return [y, *torch.autograd.grad(y, [xs, *module.parameters()], g)]

    packs = []
    real = products._pack
    monkeypatch.setattr(products, "_pack", lambda *a: packs.append(1) or real(*a))
    got = run(cell, x, gy)
    assert len(packs) == 2, "the input projection and its gradient did not both run on oneDNN"
    monkeypatch.setattr(products, "MIN_ROWS", 10**9)
    plain = run(cell, x, gy)
    assert len(packs) == 2
    exact = run(cell.double(), x.double(), gy.double())
    for k, (a, p, ref) in enumerate(zip(got, plain, exact)):
        scale = ref.abs().max().item()
        e_onednn, e_plain = ((a - ref).abs().max() / scale).item(), ((p - ref).abs().max() / scale).item()
        assert e_onednn <= 3 * e_plain + 1e-6, f"{name} output {k}: oneDNN {e_onednn:.2e}, default GEMM {e_plain:.2e}"


@pytest.mark.parametrize("rows,n,k", [(1, 300, 100), (2, 64, 32), (3, 40, 8), (4, 70, 20), (5, 1000, 33),
                                     (7, 33, 64), (8, 96, 192)])
def test_small_batch_product_matches_float64(rows, n, k):
    """rpt's small-batch product (rpt/kernels/cpu/small_batch_product.cpp) on every path: rows in threes, then a pair or a
    last single row, a width that ends inside a group of 32 columns, with and without the added term (here a
    strided view, as a step's slice of the sequence's input projection is), as accurate as torch's own GEMM."""

    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    w, h = torch.randn(n, k), torch.randn(rows, k)
    add = torch.randn(rows, 2, n)[:, 1]  # row stride 2n
    W = products.PackedLinear(w, rows, kernels.current())
    assert W.operand[1] == products.Layout.SMALL_BATCH, "a small product did not take the small-batch layout"
    exact = h.double() @ w.double().T
    for got, plain, ref in ((W(h), h @ w.T, exact), (W(h, add), torch.addmm(add, h, w.T), exact + add.double())):
        assert got.shape == (rows, n) and got.dtype == torch.float32
        scale = ref.abs().max().item()
        e_ours, e_plain = ((got - ref).abs().max() / scale).item(), ((plain - ref).abs().max() / scale).item()
        assert e_ours <= 3 * e_plain + 1e-6, f"small-batch {e_ours:.2e}, addmm {e_plain:.2e}"


def test_few_rows_or_a_cached_weight_take_the_small_batch_product():
    """The layout rule: two rows always; more while the weight read once per three rows stays within
    SMALL_BATCH_TRAFFIC, any number for a weight within CACHED_WEIGHT; oneDNN beyond, and inside onednn_products()."""

    if kernels.current().loops() is None or not products._packed_available():
        pytest.skip("needs the native loops and oneDNN")
    big, mid, small = torch.randn(2048, 512), torch.randn(1536, 384), torch.randn(768, 192)  # 4, 2.25, 0.56 MiB
    assert products.PackedLinear(big, 2, kernels.current()).operand[1] == products.Layout.SMALL_BATCH
    assert products.PackedLinear(big, 12, kernels.current()).operand[1] == products.Layout.SMALL_BATCH  # 4 passes x 4 MiB
    assert products.PackedLinear(big, 13, kernels.current()).operand[1] == products.Layout.ONEDNN
    assert products.PackedLinear(mid, 21, kernels.current()).operand[1] == products.Layout.SMALL_BATCH  # 7 passes x 2.25 MiB
    assert products.PackedLinear(mid, 22, kernels.current()).operand[1] == products.Layout.ONEDNN
    assert products.PackedLinear(small, 128, kernels.current()).operand[1] == products.Layout.SMALL_BATCH
    with kernels.use(small_batch=False):
        assert products.PackedLinear(big, 2, kernels.current()).operand[1] == products.Layout.ONEDNN
    assert products.PackedLinear(big.double(), 2, kernels.current()).operand[1] == products.Layout.PLAIN


def test_row_products_follow_their_weight_and_keep_autograd():
    """RowProducts (generation's products) keeps a packing per parameter: an in-place change of the weight (an
    optimiser step, load_state_dict) must reach the next call; a call that wants gradients is F.linear's, and
    row_products() puts it into a model's nn.Linear layers for a block only, leaving nothing behind."""
    ops = kernels.current().loops()
    if ops is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 70)
    x = torch.randn(1, 1, 40)
    rows = products.RowProducts(ops)
    with torch.no_grad():
        plain = lin(x)
        with products.row_products(lin, rows):
            first = lin(x)
        assert (id(lin.weight), products.Layout.SMALL_BATCH) in rows.packs, "the small-batch product did not run"
        assert "forward" not in vars(lin), "row_products() left its product in the layer"
        torch.testing.assert_close(first, plain, rtol=1e-5, atol=1e-5)
        many = torch.randn(9, 40)  # a server's decode batch: oneDNN's product on its own packing
        torch.testing.assert_close(rows(many, lin.weight, lin.bias), lin(many), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(-2.0)
        for y in (x, many):
            torch.testing.assert_close(rows(y, lin.weight, lin.bias), F.linear(y, lin.weight, lin.bias), rtol=1e-5,
                                       atol=1e-5)
        assert len(rows.packs) == (2 if products._packed_available() else 1)
    xg = x.clone().requires_grad_()
    rows(xg, lin.weight, lin.bias).sum().backward()
    torch.testing.assert_close(xg.grad, lin.weight.sum(0).expand_as(xg).detach())
    key = id(lin.weight)
    del lin
    assert not any(k == key for k, _ in rows.packs), "a dead weight's packing was kept"


@pytest.mark.parametrize("n", [1, 2, 5])
def test_row_products_run_a_bfloat16_weight_on_onednn_at_any_row_count(n):
    """A bfloat16 parameter (the two-level head's screen) runs on oneDNN's product at every row count, rpt's
    small-batch product being float32's only: as F.linear in bfloat16, and on a packing of its own."""
    if not (products._packed_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("no oneDNN bfloat16 product here")
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 64).bfloat16(), requires_grad=False)
    x = torch.randn(n, 64).bfloat16()
    rows = products.RowProducts(None)  # (no native loops wanted: a bfloat16 weight never takes them)
    got = rows(x, weight)
    assert (id(weight), products.Layout.ONEDNN) in rows.packs
    ref = x.double() @ weight.double().T
    assert ((got.double() - ref).abs() <= 2 ** -7 * (x.double().abs() @ weight.double().abs().T) + 1e-6).all()


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm", "mingru", "minlstm"])
def test_generation_steps_on_the_small_batch_product_equal_the_forward(cell, monkeypatch):
    """In float32 without gradients (generation) every matrix of a step, the head, attention and MLP included,
    runs rpt's small-batch product; the step-by-step logits still equal the whole-sequence forward's. The decoder's
    generate (Decoder.on) uses it and drops the packings when it ends."""
    from rpt.config import ModelConfig
    from rpt.models import RecurrentLM
    from rpt.models.decoder import Decoder

    ops = kernels.current().loops()
    if ops is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, vocab_size=50, d_model=16, d_hidden=24, n_layers=2, attention_every=2,
                                    attention_window=4, attention_heads=2, mlp_ratio=2.0)).eval()
    x = torch.randint(0, 50, (1, 9))
    rows = products.RowProducts(ops)
    with torch.no_grad():
        whole, _ = model(x)
        state = None
        for t in range(9):
            with products.row_products(model, rows):
                out, state = model.step(x[:, t], state)
            torch.testing.assert_close(out, whole[:, t], rtol=1e-4, atol=1e-5)
    missed = [name for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name
              and (id(p), products.Layout.SMALL_BATCH) not in rows.packs]
    assert not missed, f"products not on the small-batch path: {missed}"
    assert not any("forward" in vars(m) or "linear" in vars(m) for m in model.modules()), "a product stayed swapped"
    made = []
    real = products.RowProducts.__init__
    monkeypatch.setattr(products.RowProducts, "__init__", lambda self, o: real(self, o) or made.append(self))
    tokens = list(Decoder.on(model, kernels.current()).generate(x[0, :3], 5, temperature=0))
    assert len(tokens) == 5 and made and made[0].packs == {}, "generating() did not run the products or kept them"
