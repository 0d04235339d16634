"""Gated DeltaNet's forms held equal to its step (rpt/ops/gdn/spec.py) in float64: outputs, the final state and
the gradients of every input and of the entering state, with and without resets inside the window, at chunk sizes
that do and do not divide it; a chunk's affine summary against the steps; the short convolution's window form
against its step, carried inputs and resets included."""

import pytest
import torch
import torch.nn.functional as F

from rpt.ops.gdn.chunkwise import chunkwise, parallel, summary, terms
from rpt.ops.gdn.conv import conv_window
from rpt.ops.gdn.sequence import steps
from rpt.ops.gdn.spec import conv_step, gdn_step

B, H, T, DK, DV = 2, 3, 13, 4, 5


def inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, DK, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=dtype)
    decay = -F.softplus(torch.randn(B, H, T, generator=g, dtype=dtype))
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=dtype))
    S = torch.randn(B, H, DK, DV, generator=g, dtype=dtype)
    return [q, k, v, decay, beta], S


def resets():
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 0] = reset[0, 5] = reset[0, 6] = reset[1, 8] = True  # at the start, twice in a row, mid-window
    return reset


FORMS = {"parallel": parallel, **{f"chunk {c}": (lambda c: lambda *a: chunkwise(*a, chunk=c))(c) for c in (1, 4, 5, 13, 64)}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("with_resets", [False, True])
def test_every_form_equals_the_steps_with_gradients_and_states(form, with_resets):
    xs, S = inputs()
    reset = resets() if with_resets else None
    results = []
    for run in (steps, FORMS[form]):
        leaves = [x.clone().requires_grad_() for x in (*xs, S)]
        o, final = run(*leaves[:5], reset, leaves[5])
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + \
            (final * torch.randn(final.shape, generator=gen, dtype=o.dtype)).sum()
        loss.backward()
        results.append((o.detach(), final.detach(), [x.grad for x in leaves]))
    (o0, s0, g0), (o1, s1, g1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s0, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "S"], g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_a_reset_drops_the_state_before_it():
    """Outputs after a row's last reset do not depend on the entering state (nor, before it, does the other
    row's), as the step's zero state says."""
    xs, S = inputs()
    reset = resets()
    o1, _ = chunkwise(*xs, reset, S, chunk=4)
    o2, _ = chunkwise(*xs, reset, S + 1.0, chunk=4)
    torch.testing.assert_close(o1[0], o2[0], rtol=0, atol=1e-12)  # row 0 resets at its first step
    torch.testing.assert_close(o1[1, :, 8:], o2[1, :, 8:], rtol=0, atol=1e-12)
    assert (o1[1, :, :8] - o2[1, :, :8]).abs().max() > 1e-3


@pytest.mark.parametrize("with_resets", [False, True])
def test_the_summary_is_the_window_s_affine_map(with_resets):
    """S -> A S + B over a whole window (what context parallelism will fold) equals the steps' final state from
    two different entering states."""
    (q, k, v, g, beta), S = inputs()
    reset = resets()[:, None] if with_resets else None
    A, Bm = summary(k, terms(k, v, g, beta, reset))
    for start in (S, torch.randn_like(S)):
        _, final = steps(q, k, v, g, beta, None if reset is None else reset[:, 0], start)
        torch.testing.assert_close(A @ start + Bm, final, rtol=1e-10, atol=1e-10)


def test_windows_in_turn_equal_one_window():
    """The state a window hands on, carried into the next, gives what one long window gives."""
    xs, S = inputs()
    reset = resets()
    whole, end = chunkwise(*xs, reset, S, chunk=4)
    first, mid = chunkwise(*(x[:, :, :6] for x in xs), reset[:, :6], S, chunk=4)
    second, end2 = chunkwise(*(x[:, :, 6:] for x in xs), reset[:, 6:], mid, chunk=4)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end2, end, rtol=1e-10, atol=1e-10)


def test_float32_inputs_run_in_float32_and_stay_close():
    xs, S = inputs()
    o64, s64 = chunkwise(*xs, resets(), S, chunk=4)
    o32, s32 = chunkwise(*(x.float() for x in xs), resets(), S.float(), chunk=4)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s32.double(), s64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_resets", [False, True])
def test_the_convolution_s_window_equals_its_steps(with_resets):
    """Its window form against its step over the window, from carried inputs, resets masking each lag and the
    inputs carried out; and the gradients."""
    gen = torch.Generator().manual_seed(2)
    C, width = 6, 4
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64, requires_grad=True)
    inputs0 = torch.randn(B, width - 1, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, width, generator=gen, dtype=torch.float64, requires_grad=True)
    reset = resets() if with_resets else None
    reset2 = reset.clone() if with_resets else None
    if with_resets:
        reset2[1, T - 2] = True  # a reset among the last inputs: the carry must drop what came before it
    y, carry = conv_window(x, inputs0, weight, reset2)
    ys, state = [], inputs0
    for t in range(T):
        if reset2 is not None:
            state = state * (~reset2[:, t]).to(state.dtype)[:, None, None]
        y_t, state = conv_step(x[:, t], state, weight)
        ys.append(y_t)
    stepped = torch.stack(ys, dim=1)
    torch.testing.assert_close(y, stepped, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(carry, state, rtol=1e-12, atol=1e-12)
    gy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    grads = torch.autograd.grad((y * gy).sum(), [x, weight])
    grads_steps = torch.autograd.grad((stepped * gy).sum(), [x, weight])
    for a, b in zip(grads, grads_steps):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_step_over_two_thousand_tokens_in_low_precision_stays_near_float64():
    """The step form (what generation runs) from float64's inputs cast down: the state's relative error against
    float64's after 2,000 tokens, at most 1e-4 in float32 and 2e-2 in bfloat16; finite in float16."""
    steps, heads, d = 2000, 2, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(steps, heads, d, generator=gen, dtype=torch.float64) * d ** -0.5
    k = F.normalize(torch.randn(steps, heads, d, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(steps, heads, d, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(steps, heads, generator=gen, dtype=torch.float64) - 3)  # decays near 1
    beta = torch.sigmoid(torch.randn(steps, heads, generator=gen, dtype=torch.float64))

    def run(dtype):
        S = torch.zeros(heads, d, d, dtype=dtype)
        for t in range(steps):
            _, S = gdn_step(q[t].to(dtype), k[t].to(dtype), v[t].to(dtype), g[t].to(dtype), beta[t].to(dtype), S)
        return S

    exact = run(torch.float64)
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        error = (run(dtype).double() - exact).norm() / exact.norm()
        assert error <= bound, (dtype, float(error))
    assert torch.isfinite(run(torch.float16)).all()


def one_sequence_at_a_time(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """The library kernel's contract (flash-linear-attention's varlen call: [1, total, H, d], a state per
    sequence, no resets inside one), kept by running rpt's chunkwise form on each sequence by itself."""
    assert scale == 1.0 and output_final_state and q.shape[0] == 1
    outs, finals = [], []
    for i in range(len(cu_seqlens) - 1):
        part = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
        heads = [x[0, part].transpose(0, 1)[None] for x in (q, k, v, g, beta)]  # [1, H, len, ...]
        o, final = chunkwise(*heads, None, initial_state[i:i + 1], chunk=4)
        outs.append(o[0].transpose(0, 1))
        finals.append(final[0])
    return torch.cat(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("with_resets", [False, True])
def test_the_library_form_s_sequences_give_what_the_resets_give(with_resets):
    """rpt's resets mapped to the library's variable-length sequences (rows cut at their resets, the entering
    state where a row's first sequence starts, the last sequence's state after): against the chunkwise form with
    resets, outputs, state and gradients, in float64 (the kernel stood in for by rpt's own form)."""
    from rpt.ops.gdn.library import by_sequences

    xs, S = inputs()
    reset = resets() if with_resets else None
    results = []
    for run in (lambda *a: chunkwise(*a, chunk=4), lambda *a: by_sequences(one_sequence_at_a_time, *a)):
        leaves = [x.clone().requires_grad_() for x in (*xs, S)]
        o, final = run(*leaves[:5], reset, leaves[5])
        gen = torch.Generator().manual_seed(1)
        ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() +
         (final * torch.randn(final.shape, generator=gen, dtype=o.dtype)).sum()).backward()
        results.append((o.detach(), final.detach(), [x.grad for x in leaves]))
    (o0, s0, g0), (o1, s1, g1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s0, rtol=1e-10, atol=1e-10)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
