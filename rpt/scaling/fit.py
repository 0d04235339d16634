"""Fitting a scaling law to a grid's final losses, the two ways Chinchilla (Hoffmann et al. 2022) did.

Approach 3: L(N, D) = E + A / N^alpha + B / D'^beta over every point, fitted as Hoffmann et al. fit it: a Huber loss
(delta 1e-3) on log L, from a grid of starting points, by L-BFGS (torch's, in float64: no new dependency). D' is
the data's effective size: where a run passes its U unique tokens more than once, the repeated tokens are worth
less, by Muennighoff et al. 2023's rule U + U R* (1 - exp(-R / R*)) with R the repetitions beyond the first pass
and R* = 15.4, their fitted value (a grid of a few passes cannot fit R* itself). The interval of a prediction:
the spread of the fits to the points resampled (bootstrap).

Approach 2: per budget, a parabola of the loss in log N through that budget's sizes; its vertex is the budget's
compute-optimal size (where it falls inside the sizes run), and a power law N_opt = k C^a through the vertices.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

R_STAR = 15.4  # Muennighoff et al. 2023: the repetitions after which repeated data's worth has decayed by 1/e
HUBER_DELTA = 1e-3
SEARCHED = 8  # starts of the grid that L-BFGS runs from: those of the lowest objective
BOOTSTRAP = 100
PARAMS = ("E", "A", "alpha", "B", "beta")


def effective_tokens(tokens, unique) -> np.ndarray:
    """D': the training tokens' worth when `unique` of them are distinct (Muennighoff et al. 2023)."""
    tokens, unique = np.asarray(tokens, dtype=np.float64), np.asarray(unique, dtype=np.float64)
    repeats = np.maximum(0.0, tokens / unique - 1.0)
    return np.where(tokens <= unique, tokens, unique + unique * R_STAR * (1.0 - np.exp(-repeats / R_STAR)))


@dataclass(frozen=True)
class Law3:
    """L(N, D') = E + A / N^alpha + B / D'^beta, with the fits to resampled points for intervals."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    samples: tuple = ()  # (E, A, alpha, B, beta) of each bootstrap fit

    def loss(self, n, d_eff) -> np.ndarray:
        return self._loss((self.E, self.A, self.alpha, self.B, self.beta), n, d_eff)

    @staticmethod
    def _loss(p, n, d_eff) -> np.ndarray:
        E, A, alpha, B, beta = p
        return E + A / np.asarray(n, dtype=np.float64) ** alpha + B / np.asarray(d_eff, dtype=np.float64) ** beta

    def interval(self, n, d_eff, coverage: float = 0.9) -> tuple[float, float]:
        """The central `coverage` of the bootstrap fits' predictions (the point fit's twice where none)."""
        if not self.samples:
            v = float(self.loss(n, d_eff))
            return v, v
        values = [float(self._loss(p, n, d_eff)) for p in self.samples]
        tail = (1 - coverage) / 2 * 100
        return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in PARAMS}, "samples": [list(p) for p in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> "Law3":
        return cls(*(float(d[k]) for k in PARAMS), samples=tuple(tuple(p) for p in d.get("samples", ())))


def _huber(r: torch.Tensor) -> torch.Tensor:
    a = r.abs()
    return torch.where(a <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA)).sum()


def _fit_once(log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor, start) -> tuple[float, list]:
    """L-BFGS from one start in the log parameters (e, a, b, alpha, beta); (objective, parameters)."""
    theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def value():
        e, a, b, alpha, beta = theta
        pred = torch.logsumexp(torch.stack([a - alpha * log_n, b - beta * log_d, e.expand_as(log_n)]), dim=0)
        return _huber(pred - log_l)

    def objective():
        opt.zero_grad()
        v = value()
        v.backward()
        return v

    opt.step(objective)
    with torch.no_grad():
        return float(value()), theta.detach().tolist()


def _fit(n, d_eff, loss, starts) -> tuple[float, list]:
    """The best of L-BFGS from the SEARCHED starts of lowest objective (all of them evaluated at once)."""
    log_n = torch.tensor(np.log(n), dtype=torch.float64)
    log_d = torch.tensor(np.log(d_eff), dtype=torch.float64)
    log_l = torch.tensor(np.log(loss), dtype=torch.float64)
    if len(starts) > SEARCHED:
        s = torch.tensor(starts, dtype=torch.float64)[:, :, None]  # (starts, 5, 1)
        pred = torch.logsumexp(torch.stack([s[:, 1] - s[:, 3] * log_n, s[:, 2] - s[:, 4] * log_d,
                                            s[:, 0].expand(-1, len(log_n))]), dim=0)
        r = (pred - log_l).abs()
        objective = torch.where(r <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (r - 0.5 * HUBER_DELTA)).sum(1)
        starts = [starts[i] for i in torch.argsort(objective)[:SEARCHED].tolist()]
    best = (math.inf, None)
    for start in starts:
        value, theta = _fit_once(log_n, log_d, log_l, start)
        if math.isfinite(value) and value < best[0]:
            best = (value, theta)
    return best


def _as_law(theta) -> tuple:
    e, a, b, alpha, beta = theta
    return math.exp(e), math.exp(a), alpha, math.exp(b), beta


STARTS = list(itertools.product((-1.0, -0.5, 0.0, 0.5), (0.0, 2.5, 5.0, 7.5, 10.0), (0.0, 2.5, 5.0, 7.5, 10.0),
                                (0.1, 0.2, 0.3, 0.45, 0.6), (0.1, 0.2, 0.3, 0.45, 0.6)))  # e, a, b, alpha, beta


def fit_approach3(n, tokens, unique, loss, bootstrap: int = BOOTSTRAP, seed: int = 0) -> Law3:
    """The law through points of N parameters, `tokens` trained on of `unique` distinct ones, and final `loss`."""
    n, loss = np.asarray(n, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    d_eff = effective_tokens(tokens, unique)
    if len(n) < len(PARAMS):
        raise ValueError(f"approach 3 fits {len(PARAMS)} parameters: it needs at least as many points, not {len(n)}")
    _, theta = _fit(n, d_eff, loss, STARTS)
    if theta is None:
        raise ValueError("approach 3 found no finite fit to these points")
    rng, samples = np.random.default_rng(seed), []
    # resampling as many points as parameters can only draw the same set again (a zero-width interval): none then
    for _ in range(bootstrap if len(n) > len(PARAMS) else 0):
        pick = rng.integers(0, len(n), len(n))
        if len(set(pick.tolist())) < len(PARAMS):
            continue
        _, t = _fit(n[pick], d_eff[pick], loss[pick], [theta])
        if t is not None:
            samples.append(_as_law(t))
    return Law3(*_as_law(theta), samples=tuple(samples))


@dataclass(frozen=True)
class Vertex:
    """One budget's compute-optimal size by approach 2."""

    flops: float
    n_opt: float  # the parabola's vertex; where that falls outside the sizes run, the best size run
    loss: float
    inside: bool  # whether the vertex falls within the sizes run


def budget_vertex(flops: float, n, loss) -> Vertex | None:
    """The parabola of `loss` in log N through one budget's points (three sizes or more), its vertex."""
    x, y = np.log(np.asarray(n, dtype=np.float64)), np.asarray(loss, dtype=np.float64)
    if len(set(x.tolist())) < 3:
        return None
    c2, c1, c0 = np.polyfit(x, y, 2)
    v = -c1 / (2 * c2) if c2 > 0 else math.inf
    if not x.min() <= v <= x.max():  # no minimum within the sizes run: the best of them, at the grid's edge
        best = int(np.argmin(y))
        return Vertex(flops, float(math.exp(x[best])), float(y[best]), False)
    return Vertex(flops, float(math.exp(v)), float(c0 + c1 * v + c2 * v * v), True)


def power_law(vertices: list[Vertex]) -> tuple[float, float] | None:
    """(k, a) of N_opt = k C^a through the vertices inside their grids (two or more), else None."""
    inside = [v for v in vertices if v.inside]
    if len({v.flops for v in inside}) < 2:
        return None
    a, log_k = np.polyfit(np.log([v.flops for v in inside]), np.log([v.n_opt for v in inside]), 1)
    return float(math.exp(log_k)), float(a)
