"""The scaling-law fits against laws known in advance: approach 3 recovers the law its points were drawn from,
approach 2's parabola its vertex, the power law its exponent; repeated data is worth what Muennighoff et al. say."""

import math

import numpy as np
import pytest

from rpt.scaling.fit import R_STAR, Law3, budget_vertex, effective_tokens, fit_approach3, power_law, Vertex


def test_effective_tokens_counts_repeats_less():
    unique = 1e6
    d = effective_tokens([5e5, 1e6, 2e6, 4e6, 1e9], unique)
    assert d[0] == 5e5 and d[1] == 1e6  # one pass or less: every token counts
    assert 1e6 < d[2] < 2e6 and d[2] == pytest.approx(unique * (1 + R_STAR * (1 - math.exp(-1 / R_STAR))))
    assert np.all(np.diff(d) > 0)  # more passes are never worth less
    assert d[4] == pytest.approx(unique * (1 + R_STAR), rel=1e-6)  # the worth of endless repeats is bounded


def grid_points(law, unique, budgets=(1e13, 3e13, 1e14), sizes=(2e5, 5e5, 1e6, 2e6, 4e6), head=5e6):
    n, d = [], []
    for c in budgets:
        for size in sizes:
            n.append(size)
            d.append(c / (6 * size + head))
    n, d = np.array(n), np.array(d)
    return n, d, law.loss(n, effective_tokens(d, unique))


def test_approach3_recovers_the_law_it_was_drawn_from():
    truth, unique = Law3(0.9, 40.0, 0.35, 300.0, 0.4), 2.7e6
    n, d, loss = grid_points(truth, unique)
    law = fit_approach3(n, d, unique, loss, bootstrap=4)
    # the parameters trade off against each other; what must hold is the law's predictions, here and beyond the
    # grid (a 4x larger budget at the size the grid's largest budget favoured)
    for size, tokens in ((1e6, 1e7), (4e6, 1e8), (2e5, 3e6)):
        want = truth.loss(size, effective_tokens(tokens, unique))
        assert law.loss(size, effective_tokens(tokens, unique)) == pytest.approx(want, abs=2e-3)
    assert law.alpha == pytest.approx(0.35, abs=0.05) and law.beta == pytest.approx(0.4, abs=0.05)
    low, high = law.interval(1e6, 1e7)
    assert low <= high and len(law.samples) == 4


def test_approach3_needs_as_many_points_as_parameters():
    with pytest.raises(ValueError, match="at least"):
        fit_approach3([1e5, 2e5, 3e5, 4e5], [1e6] * 4, 1e7, [2.0, 1.9, 1.8, 1.7])


def test_five_points_fit_without_an_interval_a_resample_could_not_give():
    truth, unique = Law3(0.9, 40.0, 0.35, 300.0, 0.4), 2.7e6
    n, d, loss = grid_points(truth, unique)
    law = fit_approach3(n[:5], d[:5], unique, loss[:5], bootstrap=200)  # (before: ~8 copies of one fit)
    assert law.samples == ()  # every resample with five distinct points is the same five
    assert fit_approach3(n[:6], d[:6], unique, loss[:6], bootstrap=4).samples != ()


def test_approach2_vertex_and_power_law():
    # a parabola in log N with its vertex at N = 7e5
    x = np.log([1e5, 3e5, 1e6, 3e6])
    loss = 1.2 + 0.05 * (x - math.log(7e5)) ** 2
    v = budget_vertex(1e13, np.exp(x), loss)
    assert v.inside and v.n_opt == pytest.approx(7e5, rel=1e-6) and v.loss == pytest.approx(1.2)
    falling = budget_vertex(1e13, [1e5, 2e5, 4e5], [2.0, 1.9, 1.8])  # no minimum inside: the edge, said
    assert not falling.inside and falling.n_opt == pytest.approx(4e5) and falling.loss == 1.8
    assert budget_vertex(1e13, [1e5, 1e5, 2e5], [2.0, 2.0, 1.9]) is None  # two sizes make no parabola
    vertices = [Vertex(c, 3.0 * c ** 0.5, 1.0, True) for c in (1e12, 1e13, 1e14)] + [Vertex(1e15, 1.0, 1.0, False)]
    k, a = power_law(vertices)  # the vertex at the edge is left out
    assert a == pytest.approx(0.5) and k == pytest.approx(3.0)
    assert power_law(vertices[:1]) is None
