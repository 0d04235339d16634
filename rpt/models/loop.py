"""Depth recurrence: a core of blocks looped r times between a prelude and a coda (model.loop_*), as the model
that gave "recurrent pretraining" its name recurs in depth (Geiping et al. 2025), here over rpt's recurrent blocks.

    e = norm(prelude(x));  h = h0 (zero or random)
    r times:  h = norm(core(h + e))     # "linear": core(adapter(cat(h, e))), as Huginn
    y = coda(h)

Each (iteration, core block) pair carries its own state over time, so a looped model's state is r x core block
states, constant in sequence length. In training r is drawn per step (`draw_depth`, from the seed and the step: the
same on every rank and micro-batch, replayed on resume) and only the last `loop_backprop` iterations keep
gradients; at evaluation and generation the caller gives the depth (the test-time depth), loop_mean by default.
The state keeps one slot per iteration up to the most it has run; a slot a step did not reach takes the state of
the deepest iteration that step ran (as Huginn shares a token's cache when it exits early), so a later, deeper
step starts those iterations from the most recent state there is.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from rpt.config import ModelConfig
from rpt.ops.loop.spec import run_loop
from rpt.ops.stack.spec import inject

INIT_STD = 0.63  # the random first state's std (truncated at 3 std), Huginn's sqrt(2/5)
SIGMA = 0.5  # the spread of the Poisson-lognormal draw's log-rate


def draw_depth(cfg: ModelConfig, seed: int, step: int) -> int:
    """The depth of training step `step`: a function of (seed, step) alone, capped at cfg.loop_cap.

    poisson-lognormal: 1 + Poisson(l), log l ~ Normal(log(m - 1) - SIGMA^2 / 2, SIGMA), whose mean is m = loop_mean;
    uniform: 1 .. 2 m - 1 (rounded), mean m; fixed: m (rounded)."""
    rng = np.random.default_rng([seed, step, 0x6C6F6F70])  # "loop": a stream apart from the data's
    m = cfg.loop_mean
    if cfg.loop_sampler == "fixed":
        r = round(m)
    elif cfg.loop_sampler == "uniform":
        r = int(rng.integers(1, max(1, round(2 * m - 1)) + 1))
    else:
        rate = math.exp(rng.normal(math.log(m - 1) - SIGMA ** 2 / 2, SIGMA))
        r = 1 + int(rng.poisson(rate))
    return max(1, min(r, cfg.loop_cap))


def mean_depths(cfg: ModelConfig, draws: int = 4096) -> tuple[float, float]:
    """(mean r, mean min(r, k)) of the training draw: the core's forward and backward passes per step, for FLOPs."""
    r = np.array([draw_depth(cfg, 0, step) for step in range(draws)])
    return float(r.mean()), float(np.minimum(r, cfg.loop_backprop).mean())


def eval_depths(cfg: ModelConfig, given: list[int]) -> list[int]:
    """The depths a looped model's validations run at: `given` (train.eval_depths), else 1, 2, 4 and 1, 2, 4 x
    loop_mean (rounded), each once, in order."""
    m = round(cfg.loop_mean)
    return sorted(set(given or [1, 2, 4, m, 2 * m, 4 * m]))


class LoopWatch:
    """The state of the calls it watches, per iteration: its RMS, and its change from the previous iteration
    relative to its size; after the last, the tokens' spread: the RMS of each token's state minus the mean state
    over the window's tokens, over the states' RMS (0 when every token has the same state: they collapsed)."""

    def __init__(self):
        self.rms, self.change, self.spread, self.calls = [], [], 0.0, 0

    @torch.no_grad()
    def add(self, i: int, h: torch.Tensor, previous: torch.Tensor) -> None:
        if i == len(self.rms):
            self.rms.append(0.0)
            self.change.append(0.0)
        size = h.float().pow(2).mean().sqrt()
        self.rms[i] += float(size)
        self.change[i] += float((h - previous).float().pow(2).mean().sqrt() / size.clamp_min(1e-12))

    @torch.no_grad()
    def finish(self, h: torch.Tensor) -> None:
        h = h.float().flatten(0, -2) if h.dim() > 2 else h.float()
        self.spread += float((h - h.mean(0)).pow(2).mean().sqrt() / h.pow(2).mean().sqrt().clamp_min(1e-12))
        self.calls += 1

    def summary(self) -> dict:
        n = max(1, self.calls)
        return {"state_rms": [v / n for v in self.rms], "state_change": [v / n for v in self.change],
                "token_spread": self.spread / n}


class DepthLoop(nn.Module):
    """The loop's own parameters (the adapter, the norm of the state after each iteration) and its run over the
    model's blocks, which stay in RecurrentLM.blocks under their global index."""

    def __init__(self, cfg: ModelConfig, make_norm):
        super().__init__()
        self.prelude, self.core = cfg.loop_prelude, cfg.loop_core
        self.backprop, self.init, self.default_depth = cfg.loop_backprop, cfg.loop_init, round(cfg.loop_mean)
        self.slots = cfg.loop_cap  # the iterations a fresh state holds
        D = cfg.d_model
        self.adapter = nn.Linear(2 * D, D, bias=False) if cfg.loop_inject == "linear" else None
        if self.adapter is not None:  # starts as (h + e) / 2, as stable a start as "add"
            with torch.no_grad():
                self.adapter.weight.copy_(torch.cat([torch.eye(D), torch.eye(D)], dim=1) * 0.5)
        self.watch: LoopWatch | None = None  # what an evaluation reads of the state (the trainer's validations)
        self.norm = make_norm(cfg)  # of the state after each iteration
        self.inject_norm = make_norm(cfg)  # of the prelude's output: injected at the state's scale

    def init_state(self, blocks: list, batch: int, device=None, dtype=None, prelude: int | None = None) -> list:
        """Prelude blocks' states, then slot after slot of the core blocks' states, then the coda's. `prelude`: the
        prelude blocks among `blocks` (a pipeline stage may hold some of them), all by default."""
        P, C = self.prelude if prelude is None else prelude, self.core
        fresh = [b.init_state(batch, device, dtype) for b in blocks]
        return fresh[:P] + fresh[P:P + C] * self.slots + fresh[P + C:]

    def forward(self, blocks: list, x: torch.Tensor, state: list, reset, depth: int | None, step: bool, stop=None,
                shared: bool = False, prelude: int | None = None):
        """Run `blocks` (the model's, in order, of which `prelude` are prelude blocks: all by default) over x with
        the loop (rpt/ops/loop/spec.py; `stop` and `shared` as there); returns (x, the new state)."""
        return run_loop(lambda block, x, s: block(x, s, reset, step), blocks, x, state,
                        self.default_depth if depth is None else depth,
                        self.prelude if prelude is None else prelude, self.core, self.inject,
                        self.norm, self.inject_norm, self.first_state, self.backprop, self.watch, stop, shared)

    def inject(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return inject(h, e, self.adapter)

    def first_state(self, e: torch.Tensor) -> torch.Tensor:
        if self.init == "zero":
            return torch.zeros_like(e)
        return nn.init.trunc_normal_(torch.empty_like(e), std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)

    def flops_per_token(self, d_model: int) -> int:
        return 2 * 2 * d_model * d_model if self.adapter is not None else 0
