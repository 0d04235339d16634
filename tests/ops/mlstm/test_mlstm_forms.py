"""The mLSTM's forms held equal to its spec (rpt/ops/mlstm/spec.py) in float64: values, gradients of every input
and of the entering state, the final state, with and without resets, at chunk sizes that do and do not divide
the window; and the stabiliser keeping half precision finite where the gates are driven hard."""

import pytest
import torch
import torch.nn.functional as F

from rpt.ops.mlstm.chunkwise import chunkwise
from rpt.ops.mlstm.parallel import parallel
from rpt.ops.mlstm.sequence import steps


B, H, T, DK, DV = 2, 3, 13, 4, 5


def inputs(dtype=torch.float64, scale=1.0, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, DK, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g, dtype=dtype)
    i_pre = scale * torch.randn(B, H, T, generator=g, dtype=dtype)
    log_f = F.logsigmoid(scale * torch.randn(B, H, T, generator=g, dtype=dtype) + 2)
    state = (torch.randn(B, H, DK, DV, generator=g, dtype=dtype), torch.randn(B, H, DK, generator=g, dtype=dtype),
             torch.randn(B, H, generator=g, dtype=dtype))
    return [q, k, v, i_pre, log_f], state


def resets():
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 0] = reset[0, 5] = reset[0, 6] = reset[1, 8] = True  # at the start, twice in a row, mid-window
    return reset


FORMS = {"parallel": parallel, **{f"chunk {c}": (lambda c: lambda *a: chunkwise(*a, chunk=c))(c) for c in (1, 4, 5, 13, 64)}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("with_resets", [False, True])
def test_every_form_equals_the_spec_with_gradients_and_states(form, with_resets):
    xs, state = inputs()
    reset = resets() if with_resets else None
    outs = []
    for run in (steps, FORMS[form]):
        leaves = [x.clone().requires_grad_() for x in (*xs, *state)]
        h, final = run(*leaves[:5], reset, tuple(leaves[5:]))
        g = torch.Generator().manual_seed(1)
        # a loss reading the outputs and the final memory (its true scale, exp(m) C, so that the stabiliser's
        # choice cannot change it)
        loss = (h * torch.randn(h.shape, generator=g, dtype=h.dtype)).sum()
        loss = loss + (final[0] * final[2].exp()[..., None, None]).sum() + (final[1] * final[2].exp()[..., None]).sum()
        grads = torch.autograd.grad(loss, leaves)
        outs.append((h, final, grads))
    (h0, s0, g0), (h1, s1, g1) = outs
    torch.testing.assert_close(h1, h0, atol=1e-10, rtol=1e-10)
    for a, b in zip(s1, s0):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    for name, a, b in zip(["q", "k", "v", "i", "f", "C", "n", "m"], g1, g0):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"gradient of {name}: {m}")


def test_a_reset_drops_the_past_exactly():
    """After a reset at t, the outputs from t on are those of a fresh zero state started at t."""
    xs, state = inputs()
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[:, 7] = True
    h, _ = chunkwise(*xs, reset, state, chunk=4)
    zero = tuple(torch.zeros_like(s) for s in state)
    fresh, _ = chunkwise(*(x[:, :, 7:] for x in xs), None, zero, chunk=4)
    torch.testing.assert_close(h[:, :, 7:], fresh, atol=1e-12, rtol=1e-12)


def test_windows_carry_the_state():
    """Two windows, the state handed over, equal one window of both."""
    xs, state = inputs()
    whole, end = chunkwise(*xs, None, state, chunk=4)
    first, mid = chunkwise(*(x[:, :, :6] for x in xs), None, state, chunk=4)
    second, end2 = chunkwise(*(x[:, :, 6:] for x in xs), None, mid, chunk=4)
    torch.testing.assert_close(torch.cat([first, second], 2), whole, atol=1e-12, rtol=1e-12)
    for a, b in zip(end2, end):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_stabiliser_keeps_gates_at_plus_minus_30_finite(dtype):
    """Gate pre-activations driven to +-30 over a long window (an unstabilised exp(30) overflows float16 at once,
    and the sum of 200 of them float32): every output, state and gradient finite, and the outputs near the float64
    result from the same (rounded) inputs, in norm (a read whose normaliser cancels is large and ill-conditioned
    in any precision: the spec itself, one step at a time in float32, is 2e-4 off here)."""
    xs, _ = inputs(scale=30.0, T=200)
    xs[3] = 30 * torch.sign(xs[3])
    zero = (torch.zeros(B, H, DK, DV), torch.zeros(B, H, DK), torch.zeros(B, H))
    leaves = [x.to(dtype).requires_grad_() for x in xs]
    exact, _ = chunkwise(*(x.detach().double() for x in leaves), None, tuple(s.double() for s in zero), chunk=16)
    h, state = chunkwise(*leaves, None, zero, chunk=16)
    h.float().sum().backward()
    assert torch.isfinite(h).all() and all(torch.isfinite(s).all() for s in state)
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    error = ((h.double() - exact).norm() / exact.norm()).item()
    assert error < {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-3}[dtype], error
