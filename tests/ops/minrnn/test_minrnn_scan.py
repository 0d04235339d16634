"""The chunked linear scan against the plain loop: outputs and all gradients, any length, any sign."""

from __future__ import annotations

import pytest
import torch

from rpt.ops.minrnn.scan import linear_scan, linear_scan_reference


@pytest.mark.parametrize("T", [1, 2, 7, 64, 100])
def test_matches_reference_with_gradients(T):
    torch.manual_seed(T)
    B, D = 3, 5
    a = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)  # any sign, |a| > 1 included
    b = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, T, D, dtype=torch.float64)
    fast, ref = linear_scan(a, b, h0), linear_scan_reference(a, b, h0)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    # The loss reads every step and, more strongly, the final state.
    g_fast = torch.autograd.grad((fast * w).sum() + 3 * fast[:, -1].sum(), (a, b, h0))
    g_ref = torch.autograd.grad((ref * w).sum() + 3 * ref[:, -1].sum(), (a, b, h0))
    for x, y in zip(g_fast, g_ref):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_long_decaying_sequences_stay_accurate_in_float32():
    torch.manual_seed(0)
    B, T, D = 2, 2048, 16
    a = torch.rand(B, T, D) * 0.2  # strong decay: cumulative products underflow within a chunk
    b = torch.randn(B, T, D)
    h0 = torch.randn(B, D) * 100
    ref = linear_scan_reference(a.double(), b.double(), h0.double())
    torch.testing.assert_close(linear_scan(a, b, h0).double(), ref, rtol=1e-5, atol=1e-5)
