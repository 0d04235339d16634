"""The default recipe: what `rpt train` chooses for the settings nobody gave (no --config, or a preset with
`train.recipe = "auto"`).

First the recurrent family (FAMILIES: the one measured best on the run's device), the head (a two-level
softmax's shortlist where it costs at most half a full softmax: token frequencies of the training split) and the
precision (BF16_FAMILIES: bf16 where the CPU has bf16 units and the family was measured to keep its loss). Then rank
0 times optimiser steps of one size on this machine, once for each batch shape it plans (random tokens drawn as
often as the corpus has them: measure_speed), scales that speed by FLOPs to a ladder of sizes and families (their
parameters and FLOPs asked of the run's cell), reads the corpus's training tokens, and from the budget derives how
many passes over the data each would make. A corpus the budget passes over many times is over-fitted long before the budget
ends, so the recipe regularises by the passes (dropout, embedding dropout, weight drop; SGD with momentum for
AdamW; early stopping armed); a corpus larger than the budget gets none of them, and the widest model that still
sees enough tokens per parameter (width before depth). Where the plain stack and the stack with sliding-window
attention in every 2nd block both make more than REGIME_PASSES passes, the data limits the run: the family takes
the attention, SGD with momentum replaces AdamW and the rows a step stay the default's; where the run at
COMPUTE_BOUND_BATCH rows a step (4 x the default's) makes fewer, the compute limits it, and those larger steps
reach a lower loss in the same time (a step budget keeps its batch). Dropout grows gradually from FREE_PASSES. Each
decision is made on the passes of the configuration it leads to, so every line printed agrees. A regulariser the
cell does not take (weight drop beside lstm) is left out. The periodic validation is sized to cost a small share of
the budget (and, where the steps are known, to come at least MIN_VALIDATIONS times), the warm-up to at most a tenth
of the steps the budget gives. Every choice is printed with its reason, written into the run's config.toml, and a
key given with --set (or by a file) is never touched. The recipe's time is outside train.max_time (which budgets
training), and at most RECIPE_SHARE of it. The rules and the runs that set them: benchmarks/results/quality.md
(issues 22, 44, 59).
"""

from __future__ import annotations

import dataclasses

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rpt.models.registry import cell_options, get_cell
from rpt.ops import precision
from rpt.models.shapes import on_meta

# width before depth: each size is (n_layers, d_model)
LADDER = ((2, 128), (2, 192), (2, 256), (2, 384), (2, 512), (2, 768), (3, 1024), (4, 1536), (4, 2048))
TOKENS_PER_PARAM = 0.4  # the least training tokens per recurrent parameter a size must see within the budget
FREE_PASSES = 2.0  # passes over the data that need no regularisation; then 0.1 more strength per doubling
# Past this many passes the data, not the compute, limits the run (attention, SGD, the default's rows a step); under
# it the compute-bound choices. Measured on both sides: at 2.4 passes (an 11.7 MB corpus, 1,200 s) the compute-bound
# choices reached 0.70 bits per byte where the data-bound ones reached 0.95; at 5.7 passes (tiny-shakespeare,
# 600 s) SGD reached 1.986 where AdamW reached 2.021 (benchmarks/results/quality.md, issues 44 and 59)
REGIME_PASSES = 4.0
# each regulariser at its share of that strength (at most 0.5): the residual branches', the embedding's, the
# recurrent matrix's (lstm: the only cell with weight drop)
REGULARISERS = {"model.dropout": 1.0, "model.embed_dropout": 1.5, "model.weight_drop": 2.0}
# and, past REGIME_PASSES, SGD with momentum in place of AdamW (word_language_model's clip)
MANY_PASSES_OPTIMIZER = {"train.optimizer": "sgd", "train.lr": 1.0, "train.grad_clip": 0.25}
ATTENTION_EVERY = 2  # the attended stack: sliding-window attention in every 2nd block of the recurrent stack
COMPUTE_BOUND_BATCH = 64  # rows a step where the budget makes under REGIME_PASSES passes (4 x the default's)
HEAD_SAVING = 2.0  # a two-level softmax only where its expected cost is at most 1 / this of the full one
EVAL_SHARE = 0.025  # of the budget, for the recipe's own timing and the periodic validations together
RECIPE_SHARE = 0.05  # of a time budget: the most the recipe may take (outside the budget)
RESERVE = 0.8  # of that share, what the measuring plans for: the rest for a step that runs longer than the one before
PROBE_LEN = 8  # tokens a row of the first, short measuring steps (a whole window's step may not fit the share)
MIN_EVAL_SHARE = 0.01  # what the validations keep however long the timing took
EVAL_TOKENS = 4096  # of a periodic validation (the whole split when that is smaller)
FORWARD_SHARE = 0.4  # a validation token's cost against a training token's (forward only, no optimiser)
MIN_VALIDATIONS = 4  # periodic validations a run of known steps (a step or token budget) makes at least
WARMUP_STEPS, WARMUP_SHARE = 50, 0.1  # the learning rate's warm-up: 50 steps, at most a tenth of the run's
MEASURED_STEPS = 5  # whole windows' steps of the one size measured after the first, at most


# The recurrent family where none is given, by the device the run trains on: the family measured best there at the
# scaling curve's budgets, and the figures (benchmarks/results/quality.md, issue 59). A device not listed gets the CPU's
# choice, said as unmeasured; no candidate is left for timing until a device's measurements leave two.
FAMILIES = {"cpu": ("lstm", "on the embedded corpus at equal time, ahead of minGRU by 0.011 bits per byte and of "
                            "mlstm by 0.019 at 300 s; at 1,200 s mlstm led by 0.009 in one run, twice the lstm's "
                            "run-to-run spread: not yet a rule")}

# the families that train in bf16 on a CPU with bf16 units, and the measurement that chose each (1.6x float32's
# tokens/s or more, the validation loss at equal steps within 0.01 bits per byte)
BF16_FAMILIES = {
    "lstm": "oneDNN's LSTM in bf16 trained 1.65x float32's tokens/s at 2 x 512 (64 x 64 tokens a step), the "
            "validation loss after 200 steps 0.002 bits per byte lower",
    "gru": "its projections and head in bf16 trained 1.18x float32's tokens/s at 2 x 512, the validation loss "
           "after 120 steps the same (+0.0000 bits per byte)",
    "modlstm": "its projections and head in bf16 trained 1.24x float32's tokens/s at 2 x 512, the validation loss "
               "after 120 steps the same (+0.0001 bits per byte)",
    "mingru": "its projections and head in bf16 trained 1.79x float32's tokens/s at 2 x 512, the validation loss "
              "after 120 steps +0.003 bits per byte",
    "minlstm": "its projections and head in bf16 trained 1.70x float32's tokens/s at 2 x 512, the validation loss "
               "after 120 steps the same (-0.0000 bits per byte)",
    "gdn": "its projections and head in bf16 trained 1.44x float32's tokens/s at 2 x 512 (4 heads), the validation "
           "loss after 120 steps the same (+0.0002 bits per byte)"}
# (mlstm: 1.60x, but +0.007 bits per byte after 120 steps in two runs, above two runs' spread: float32)

# every key the recipe may choose (a key a file or --set gives is left alone)
CHOOSES = frozenset({"model.cell", "train.precision", "model.n_layers", "model.d_model", "model.head_shortlist", "model.attention_every",
                     "train.batch_size", *REGULARISERS, *MANY_PASSES_OPTIMIZER, "train.early_stop",
                     "train.eval_tokens", "train.eval_interval", "train.warmup_steps"})


@dataclass(frozen=True)
class Choice:
    key: str
    value: object
    why: str


def lstm_params(n_layers: int, d_model: int) -> int:
    """An lstm stack's parameters beside the embedding: four gates over input and state per layer (the count where
    no cell is named)."""
    return n_layers * 8 * d_model * (d_model + 1)


def recurrent_params(model_cfg, size) -> int:
    """The recurrent parameters of `size` of this model: its cells' (asked of the cell, built on the meta device),
    what the budget's tokens per parameter are counted against."""
    from rpt.models.lm import build_cell

    with on_meta():
        cell = build_cell(sized(model_cfg, size))
    return size[0] * sum(p.numel() for p in cell.parameters())


def tokens_of(budget: dict, tokens_per_s: float, tokens_per_step: int, flops_per_token: float = 0.0) -> float:
    """The training tokens a budget ({"seconds"|"tokens"|"steps"|"flops": n}) holds at this speed (a FLOP budget:
    for a model of `flops_per_token`)."""
    if "seconds" in budget:
        return tokens_per_s * budget["seconds"] * (1 - EVAL_SHARE)
    if "flops" in budget:
        return budget["flops"] / flops_per_token
    return budget["tokens"] if "tokens" in budget else budget["steps"] * tokens_per_step


def fits(size, budget: dict, tokens_per_s: float, tokens_per_step: int, params: int | None = None,
         flops_per_token: float = 0.0) -> bool:
    """Whether `size` (of `params` recurrent parameters: an lstm's where not given) sees TOKENS_PER_PARAM."""
    return tokens_of(budget, tokens_per_s, tokens_per_step, flops_per_token) >= \
        TOKENS_PER_PARAM * (params or lstm_params(*size))


def choose(train_tokens: int, val_tokens: int, budget: dict, speeds: dict, tokens_per_step: int,
           given: frozenset, spent: float = 0.0, facts: dict | None = None,
           params: dict | None = None, flops: dict | None = None, law=None) -> list[Choice]:
    """The choices for a corpus of `train_tokens` and a budget ({"seconds"|"tokens"|"steps"|"flops": n}), with
    `speeds` {(n_layers, d_model): training tokens per second on this machine}, `params` {size: recurrent
    parameters} (an lstm's where not given) and `flops` {size: training FLOPs a token} (for a FLOP budget); `law`: a
    scaling law's group (rpt/scaling/law.py) the size is chosen from, where given; keys in `given` are left alone. `spent`: the share of the budget the
    timing took, which the validations' share gives up. `facts`, where given, receives the passes over the data
    the chosen size makes."""
    params, flops = params or {size: lstm_params(*size) for size in speeds}, flops or {}

    def tokens_of_size(size) -> float:
        return tokens_of(budget, speeds[size], tokens_per_step, flops.get(size, 0.0))

    sized = "model.d_model" in given or "model.n_layers" in given
    predicted = None
    if sized:
        size = next(iter(speeds))  # the run's own size, the one measured
    elif law is not None:  # the least loss the law predicts, each size on the tokens (and passes) it would see
        predicted = {s: law.predict(params[s], tokens_of_size(s), max(train_tokens, 1)) for s in speeds}
        size = min(speeds, key=lambda s: predicted[s][0])
    else:  # the widest that fits, or the smallest when none does
        fitting = [s for s in speeds if fits(s, budget, speeds[s], tokens_per_step, params[s], flops.get(s, 0.0))]
        size = max(fitting, key=params.get) if fitting else min(speeds, key=params.get)
    passes = tokens_of_size(size) / max(train_tokens, 1)
    if facts is not None:
        facts["passes"] = passes
        if predicted:
            facts["predicted"] = predicted[size]
    choices = []
    if predicted:
        loss, low, high = predicted[size]
        runner_up = min((s for s in speeds if s != size), key=lambda s: predicted[s][0], default=None)
        why = (f"the least loss the scaling law predicts at this budget: {loss:.3f} bits per byte [{low:.3f}, "
               f"{high:.3f}] on {tokens_of_size(size):,.0f} tokens, {passes:.1f} passes over {train_tokens:,}" +
               (f" (next: {runner_up[0]} x {runner_up[1]}, {predicted[runner_up][0]:.3f})" if runner_up else ""))
        choices += [Choice("model.n_layers", size[0], why), Choice("model.d_model", size[1], why)]
    elif not sized:
        why = (f"the widest size that sees {TOKENS_PER_PARAM:g} token per recurrent parameter within the budget "
               f"({tokens_of_size(size):,.0f} tokens, {passes:.1f} passes over {train_tokens:,})")
        choices += [Choice("model.n_layers", size[0], why), Choice("model.d_model", size[1], why)]
    strength = min(0.5, 0.1 * math.log2(passes / FREE_PASSES)) if passes > FREE_PASSES else 0.0
    why = f"{passes:.1f} passes over the training tokens" + (
        ": over-fitting to hold back" if strength else f": none needed up to {FREE_PASSES:g}")
    for key, scale in REGULARISERS.items():
        choices.append(Choice(key, round(min(0.5, scale * strength), 2), why))
    if passes > REGIME_PASSES and not given & {"train.optimizer", "train.lr"}:  # a given lr is AdamW's or SGD's
        why = f"{passes:.1f} passes: SGD with momentum keeps generalising where AdamW over-fits after about one"
        choices += [Choice(key, value, why) for key, value in MANY_PASSES_OPTIMIZER.items()]
    choices.append(Choice("train.early_stop", 0.25 if passes > 1 else 0.0,
                          "armed: validation will stop improving before the budget ends" if passes > 1 else
                          "off: less than one pass, validation keeps improving"))
    steps = tokens_of_size(size) / tokens_per_step  # what the budget gives at this speed
    if facts is not None:
        facts["steps"] = steps
    eval_tokens = min(EVAL_TOKENS, val_tokens)
    share = max(MIN_EVAL_SHARE, EVAL_SHARE - spent)
    interval = max(1, math.ceil(eval_tokens * FORWARD_SHARE / (share * tokens_per_step)))
    # a short run: its validations, not their share, decide; where the steps are known (under a time budget, at the
    # machine's pace, the trainer validates at least every third of the budget: rpt/train/evaluate.py)
    if "seconds" not in budget and interval > steps / MIN_VALIDATIONS:
        interval = max(1, math.ceil(steps / MIN_VALIDATIONS))
        why = (f"a validation of {eval_tokens:,} tokens every {interval} steps: at least {MIN_VALIDATIONS} in "
               f"the {steps:,.0f} steps the budget gives" if interval * MIN_VALIDATIONS <= steps else
               f"a validation of {eval_tokens:,} tokens every {interval} steps of the {steps:,.0f} the budget gives")
    else:
        why = f"a validation of {eval_tokens:,} tokens every {interval} steps costs about {share:.1%} of training"
    choices += [Choice("train.eval_tokens", eval_tokens, why), Choice("train.eval_interval", interval, why)]
    warmup = min(WARMUP_STEPS, max(1, int(steps * WARMUP_SHARE)))
    choices.append(Choice("train.warmup_steps", warmup, f"at most {WARMUP_SHARE:.0%} of the {steps:,.0f} steps "
                          "the budget gives, so that the learning rate decays over the rest" if warmup < WARMUP_STEPS
                          else f"{WARMUP_STEPS} of the {steps:,.0f} steps the budget gives"))
    return [c for c in choices if c.key not in given]


def shortlist_for(counts: np.ndarray) -> Choice:
    """The two-level softmax's shortlist (`ClusteredHead`) of the least expected cost: a power of two S from
    256 to a quarter of the vocabulary, costing S + 1 logits a token plus the vocabulary beyond S for the share
    of tokens outside it; none (0) unless that saves HEAD_SAVING x of the full softmax."""
    V = len(counts)
    frequent = np.cumsum(np.sort(np.asarray(counts, dtype=np.float64))[::-1]) / max(1.0, float(np.sum(counts)))
    best, cost = 0, float(V)
    for S in (1 << k for k in range(8, max(8, V.bit_length() - 2))):
        c = S + 1 + (1 - frequent[S - 1]) * (V - S)
        if c < cost:
            best, cost = S, c
    if best and cost * HEAD_SAVING <= V:
        return Choice("model.head_shortlist", best, f"the {best:,} most frequent tokens are {frequent[best - 1]:.0%} "
                      f"of the training text: a two-level softmax costs {cost / V:.0%} of a full one over {V:,}")
    return Choice("model.head_shortlist", 0, f"no shortlist of this vocabulary ({V:,}) saves {HEAD_SAVING:g} x "
                  "of a full softmax")


def head_choice(cfg, counts: np.ndarray) -> list[Choice]:
    """The shortlist, unless given."""
    if "model.head_shortlist" in cfg.given:
        return []
    return [shortlist_for(counts)]


def attention_choice(cfg, plain: float, attended: float) -> list[Choice]:
    """Attention in the stack or none, from the passes over the data the plain stack makes and those the stack with
    attention in every ATTENTION_EVERY-th block makes (each at the size the recipe picks for it): where both exceed
    REGIME_PASSES the data, not the compute, limits the run, and the stack spends the compute to spare on
    sliding-window attention (exact recall of the last window's tokens, which a fixed-size state only
    approximates); otherwise attention's cost buys less than the tokens it takes. Left alone where the user chose
    attention (or none) or the size, whose blocks it would share."""
    if {"model.attention_every", "model.n_layers", "model.d_model"} & cfg.given:
        return []
    if plain > REGIME_PASSES and attended > REGIME_PASSES:
        return [Choice("model.attention_every", ATTENTION_EVERY, f"{attended:.1f} passes with it ({plain:.1f} "
                       f"without): compute to spare, which attention every {ATTENTION_EVERY}nd block turns into "
                       "better held-out text (benchmarks/results/quality.md, issue 44)")]
    why = (f"{plain:.1f} passes: compute is short" if plain <= REGIME_PASSES else
           f"{plain:.1f} passes without it, but {attended:.1f} with it: no compute to spare")
    return [Choice("model.attention_every", 0, why + ", and attention's cost would buy less than the tokens it "
                   "takes")]


def cell_choice(cfg, device: torch.device) -> list[Choice]:
    """The recurrent family (`model.cell`) by FAMILIES, unless given. Attention every k blocks, the other half of
    the family, follows from the passes (attention_choice)."""
    if "model.cell" in cfg.given:
        return []
    if device.type in FAMILIES:
        cell, why = FAMILIES[device.type]
        return [Choice("model.cell", cell, f"the recipe's family for a {device.type} (a fixed rule, measured on the "
                       f"build machine's 2-core CPU, not on this one): {why}")]
    cell, _ = FAMILIES["cpu"]
    return [Choice("model.cell", cell, f"the CPU's measured choice: the families are not yet measured on "
                   f"{device.type} (benchmarks/results/quality.md, issue 59)")]


def precision_choice(cfg, device: torch.device, cell: str) -> list[Choice]:
    """bf16 for a family of BF16_FAMILIES on a CPU with bf16 units (oneDNN's bf16 support: avx512_bf16 or AMX),
    unless the precision was given; float32 elsewhere, said why."""
    if "train.precision" in cfg.given or device.type != "cpu":
        return []
    if cell in BF16_FAMILIES and precision.cpu_has_bf16_units():
        return [Choice("train.precision", "bf16", f"this CPU has bf16 units: {BF16_FAMILIES[cell]} "
                       "(benchmarks/results/quality.md, issue 70)")]
    why = (f"{cell} has not been measured to keep its loss in bf16 (or lost some)" if cell not in BF16_FAMILIES else
           "this CPU has no bf16 units (oneDNN would emulate them)")
    return [Choice("train.precision", "fp32", why)]


def batch_open(cfg, rank_tokens: int) -> bool:
    """Whether the recipe may choose the rows a step: not where given, under a step budget (whose steps' size the
    user chose with it), where the batch would not divide into the run's micro-batches, or where a rank's
    `rank_tokens` are too few for COMPUTE_BOUND_BATCH streams of two windows each (the stream loader's least)."""
    return not ("train.batch_size" in cfg.given or "steps" in budget_of(cfg.train) or
                COMPUTE_BOUND_BATCH % cfg.train.grad_accum or COMPUTE_BOUND_BATCH % cfg.parallel.microbatches or
                rank_tokens <= COMPUTE_BOUND_BATCH * 2 * cfg.train.seq_len)


def batch_choice(cfg, larger: float, kept: float) -> list[Choice]:
    """The rows a step, from the passes over the data the run makes at COMPUTE_BOUND_BATCH rows, `larger` (where
    the recipe may choose them: batch_open): under REGIME_PASSES the compute, not the data, limits it, and
    COMPUTE_BOUND_BATCH rows a step (4,096 tokens at the default window) reach a lower loss in the same time than the
    default's 16 (steps of less noise, and more tokens a second from the larger matrix products); beyond, the data
    limits it and the smaller batches' more steps are kept (`kept`: the passes they make, which the line gives)."""
    if larger < REGIME_PASSES:
        return [Choice("train.batch_size", COMPUTE_BOUND_BATCH, f"{larger:.1f} passes: compute is short, and larger "
                       "steps reach a lower loss in the same time (benchmarks/results/quality.md, issue 44)")]
    why = ("the data limits the run" if kept >= REGIME_PASSES else
           f"at {COMPUTE_BOUND_BATCH} rows a step (more tokens a second) the data would limit the run")
    return [Choice("train.batch_size", cfg.train.batch_size, f"{kept:.1f} passes: {why}, and smaller batches' "
                   "more steps generalise better")]


def measure_speed(cfg, size, device: torch.device, counts: np.ndarray, limit: float) -> tuple[float, bool]:
    """(training tokens per second of one size, whether measured on whole windows). Optimiser steps (forward,
    backward, AdamW) on random tokens of the run's batch shape, drawn as often as `counts` (per token id) has them
    (a two-level head's cost depends on how often the targets fall outside its shortlist): two on PROBE_LEN tokens
    of each row (the first pays the one-time costs), each next on twice as many up to the whole window, taken only
    where twice the last step's time fits in what is left of `limit` s (a short step's time is mostly fixed costs,
    which under contention swell: scaling it by the tokens misjudged whole windows 20-fold); then up to
    MEASURED_STEPS more whole windows, as time allows. The speed: the median of the whole windows' steps after the
    first (which pays that shape's one-time costs), else the longest step's."""
    from rpt.models import RecurrentLM

    from rpt.parallel.runner import autocast_for

    B, T = cfg.train.batch_size, cfg.train.seq_len
    began = time.perf_counter()
    model = RecurrentLM(sized(cfg.model, size)).to(device)
    if cfg.model.head_shortlist:
        model.head.assign(counts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    frequency = torch.from_numpy(np.asarray(counts, dtype=np.float64) + 1e-9)
    x = torch.multinomial(frequency, B * (T + 1), replacement=True,
                          generator=torch.Generator().manual_seed(0)).view(B, T + 1).to(device)

    def step(t: int) -> float:
        """One optimiser step over the first t tokens of every row; its seconds."""
        step_began = time.perf_counter()
        with autocast_for(cfg.train.precision, device):  # the run's precision: bf16 where the recipe chose it
            nats, _ = model(x[:, :t], targets=x[:, 1:t + 1])
        nats.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - step_began

    t = min(T, PROBE_LEN)
    step(t)  # the one-time costs (the first use of each kernel): not the machine's pace
    speed = B * t / (last := step(t))
    while t < T and 2 * last <= limit - (time.perf_counter() - began):
        t = min(T, 2 * t)
        speed = B * t / (last := step(t))
    if t < T:
        return speed, False
    whole = [speed]  # the first at the whole window: its shape's one-time costs
    while len(whole) <= MEASURED_STEPS and last <= limit - (time.perf_counter() - began):
        whole.append(B * T / (last := step(T)))
    return float(np.median(whole[1:] or whole)), True


def contention(cores_busy_elsewhere: float, threads: int, cores: int) -> str | None:
    """A remark when the measured speed looks like an oversubscribed machine: torch's threads and what other
    processes kept busy during the measurement together want more cores than there are."""
    if cores_busy_elsewhere < 0.5 or cores_busy_elsewhere + threads <= cores + 0.25:
        return None
    return (f"the machine looks oversubscribed: other processes kept {cores_busy_elsewhere:.1f} of its {cores} "
            f"cores busy while torch ran {threads} threads here, so the speed measured (and the size chosen for "
            "it) is below what a quiet machine gives; fewer threads (OMP_NUM_THREADS) or a quieter machine train "
            "faster")


class CoreUse:
    """Cores kept busy by other processes over an interval: the machine's busy time (/proc/stat) less this
    process's own CPU time, per second of wall time. Linux only (elsewhere: unknown, None)."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle and iowait
        return (sum(fields) - idle) / tick, time.process_time(), time.perf_counter()

    def elsewhere(self) -> float | None:
        end = self._read()
        if self.start is None or end is None or end[2] - self.start[2] < 0.05:
            return None
        busy, mine, wall = (b - a for a, b in zip(self.start, end))
        return max(0.0, (busy - mine) / wall)


def sized(model_cfg, size):
    return dataclasses.replace(model_cfg, n_layers=size[0], d_model=size[1])


def flops_of(model_cfg, size, counts: np.ndarray) -> int:
    from rpt.models import RecurrentLM

    with on_meta():
        model = RecurrentLM(sized(model_cfg, size))
    if model_cfg.head_shortlist:  # its tail's cost is the share of tokens outside the shortlist
        model.head.assign(counts)
    return model.flops_per_token()


def budget_of(train) -> dict:
    """The budget that ends the run first is not known before it runs: the time budget when there is one."""
    if train.max_time:
        return {"seconds": train.max_time}
    if train.max_flops:
        return {"flops": train.max_flops}
    return {"tokens": train.max_tokens} if train.max_tokens else {"steps": train.max_steps}


def apply_recipe(cfg, dist_info, train_tokens: int, val_tokens: int, counts: np.ndarray) -> float:
    """Apply the recipe to `cfg` (a thawed copy, being resolved: rpt/train/resolve.py) alike on every rank: rank 0
    measures and chooses, the others receive its choices. `counts`: occurrences of each token id in (a sample of)
    the training split, its length the vocabulary. The lines that say what was chosen and why join cfg.notes; the
    time it took comes off a time budget, and is returned."""
    import torch._dynamo  # noqa: F401 (fused AdamW imports it, ~1 s: a cost of the run's start, not the recipe's)
    import torch.distributed as dist

    began = time.perf_counter()
    choices = remarks = None
    if dist_info.rank == 0:
        choices, remarks = _choose_here(cfg, dist_info.device, train_tokens, val_tokens, counts,
                                        dist_info.world_size)
        cell = next((c.value for c in choices if c.key == "model.cell"), cfg.model.cell)
        takes = get_cell(cell).options  # the cell options this cell does not take are left out
        choices = [c for c in choices if c.key.removeprefix("model.") not in cell_options() or
                   c.key.removeprefix("model.") in takes]
    if dist_info.world_size > 1:
        box = [(choices, remarks)]
        dist.broadcast_object_list(box, src=0)
        choices, remarks = box[0]
    for c in choices:
        cfg.set(c.key, c.value, origin="the default recipe")
    seconds = time.perf_counter() - began
    notes = [f"the default recipe ({seconds:.1f} s; --set any of these to choose it yourself):"]
    notes += [f"  {c.key} = {c.value}: {c.why}" for c in choices] + [f"  note: {r}" for r in remarks]
    cfg.notes = [*cfg.notes, *notes]
    cfg.validate()
    return seconds


def _choose_here(cfg, device, train_tokens: int, val_tokens: int, counts: np.ndarray,
                 world_size: int = 1) -> tuple[list[Choice], list]:
    """The choices, and remarks on the measuring (where it was cut short or contended). One size is measured
    at each batch shape planned (Timing); every configuration's speed follows from its batch's by FLOPs, and each
    decision (the family, the batch) is made on the passes of the configuration it leads to, so that every line the
    recipe prints agrees."""
    began = time.perf_counter()
    family, head = cell_choice(cfg, torch.device(device)), head_choice(cfg, counts)
    given_attention = cfg.model.attention_every if "model.attention_every" in cfg.given else 0
    model = dataclasses.replace(cfg.model, vocab_size=len(counts), attention_every=given_attention,
                                **{c.key.removeprefix("model."): c.value for c in family + head})
    precision = precision_choice(cfg, torch.device(device), model.cell)
    train = dataclasses.replace(cfg.train, **{c.key.removeprefix("train."): c.value for c in precision})
    timing = Timing(cfg, model, train, device, counts, began)

    def plan(attention: int, batch: int) -> tuple[list[Choice], dict]:
        facts = {}
        return _sized(cfg, timing, attention, batch, train_tokens, val_tokens, facts), facts

    sized, facts = plan(given_attention, cfg.train.batch_size)
    attention = batch = []
    if not {"model.attention_every", "model.n_layers", "model.d_model"} & cfg.given:
        attended, with_it = plan(ATTENTION_EVERY, cfg.train.batch_size)
        attention = attention_choice(cfg, facts["passes"], with_it["passes"])
        if attention[0].value:
            sized, facts = attended, with_it
    if batch_open(cfg, train_tokens // world_size):
        larger, at_larger = plan(given_attention, COMPUTE_BOUND_BATCH)
        batch = batch_choice(cfg, facts["passes"] if attention and attention[0].value else at_larger["passes"],
                             facts["passes"])
        if batch[0].value == COMPUTE_BOUND_BATCH:
            sized = larger
            if attention:  # (none, as compute is short) said on the passes of the larger batch's run it leads to
                attention = attention_choice(cfg, at_larger["passes"], with_it["passes"])
    choices = family + precision + attention + batch + head + sized
    if cfg.comm.mode == "diloco":  # the replicas agree only at outer steps, where validations must fall
        every = cfg.comm.diloco_steps
        choices = [Choice(c.key, math.ceil(c.value / every) * every,
                          f"{c.why}; a multiple of comm.diloco_steps = {every}")
                   if c.key == "train.eval_interval" else c for c in choices]
    return choices, timing.remarks()


def law_group(cfg, model) -> tuple[object, str | None]:
    """The group of recipe.law (where one is given) that sizes this family at this vocabulary, and a remark on it:
    where it came from, or why it cannot size this run."""
    if not cfg.recipe.law:
        return None, None
    from rpt.scaling.law import Law

    law = Law.load(cfg.recipe.law)
    group = law.group(model.cell, model.vocab_size)
    p = law.provenance
    source = (f"the scaling law {cfg.recipe.law} (fitted at rpt {p.get('rpt_commit')} on {', '.join(p['corpora'])}, "
              f"{p['points_fitted']} runs to {max(p['budgets_fitted']):.3g} FLOPs, on {p['machine']})")
    if group is None:
        return None, (f"{source} holds no {model.cell} runs: the size follows the ladder's rule")
    vocab = "" if group.vocab == model.vocab_size else f"; fitted at a {group.vocab:,}-token vocabulary, not {model.vocab_size:,}"
    return group, f"sized by {source}{vocab}"


class Timing:
    """The recipe's measurement of speed on this machine: the run's own size where given, else REFERENCE, at each
    batch shape a plan asks about and the family as given, within RECIPE_SHARE of a time budget (measure_speed).
    Every other size and family takes its batch's speed scaled by FLOPs; where a scaling law sizes the run, the size
    it chose is timed too, and the speeds follow the line through both. Each batch is timed itself: on a CPU 64
    rows a step train more tokens a second than 16, and sizing the larger batch's run from the smaller's speed
    foresaw 0.7x the tokens it trained (benchmarks/results/quality.md). Measured at the first use, and only under a
    time budget (the others need no speed)."""

    REFERENCE = (2, 256)

    def __init__(self, cfg, model, train, device, counts: np.ndarray, began: float):
        """`model`, `train`: the sections as the recipe has chosen so far (the family, the precision)."""
        self.cfg, self.model, self.train = cfg, model, train
        self.device, self.counts, self.began = torch.device(device), counts, began
        self.allowance = RECIPE_SHARE * cfg.train.max_time if cfg.train.max_time else math.inf
        self.size = (cfg.model.n_layers, cfg.model.d_model) if {"model.d_model", "model.n_layers"} & cfg.given \
            else self.REFERENCE
        self.measured: dict = {}  # (size, rows a step) -> tokens per second as measured (self.size first)
        self.flops_of: dict = {}  # (attention_every, size) -> FLOPs a token
        self.params_of: dict = {}  # size -> recurrent parameters
        self.cut: list[str] = []  # the measurement cut short
        self.cores = CoreUse()
        self.law, self.law_said = law_group(cfg, model)

    def measure(self, size, batch: int) -> bool:
        """Time `size` at `batch` rows a step (once); after the first only where the recipe's share of the budget
        has time left. Whether it was measured now."""
        left = RESERVE * self.allowance - (time.perf_counter() - self.began)
        if (size, batch) in self.measured or (self.measured and left <= 0):
            return False
        run = type(self.cfg)()
        run.model, run.train = self.model, dataclasses.replace(self.train, batch_size=batch)
        speed, whole = measure_speed(run, size, self.device, self.counts, left)
        if not whole:
            self.cut.append(f"{size[0]} x {size[1]} at {batch} rows from steps of {PROBE_LEN} tokens a row "
                            f"({speed:,.0f} tokens/s)")
            if self.measured:  # a second speed from short steps would only blur the first's
                return False
        self.measured[size, batch] = speed
        return True

    def speeds(self, sizes, attention: int, batch: int) -> dict:
        """Training tokens per second of each size of the family with `attention` at `batch` rows a step: the
        measured size's FLOP/s for all; where two sizes were measured, a seconds-a-token line through both, t = a +
        b x FLOPs (a: what a token costs beside its products, the larger share of a small model's time on a CPU).
        A batch the share left no time to measure takes the nearest batch's speeds."""
        self.measure(self.size, batch)
        rows = min({b for _, b in self.measured}, key=lambda b: abs(b - batch))
        at = {self.flops(self.model.attention_every, s): v for (s, b), v in self.measured.items() if b == rows}
        if len(at) >= 2:
            b, a = np.polyfit(list(at), [1 / v for v in at.values()], 1)
            if a > 0 and b > 0:
                return {s: 1 / (a + b * self.flops(attention, s)) for s in sizes}
        flops, speed = next(iter(at.items()))
        return {s: speed * flops / self.flops(attention, s) for s in sizes}

    def params(self, size) -> int:
        """The recurrent parameters of `size` of this model's cell (cached)."""
        if size not in self.params_of:
            self.params_of[size] = recurrent_params(self.model, size)
        return self.params_of[size]

    def flops(self, attention: int, size) -> int:
        if (attention, size) not in self.flops_of:
            family = dataclasses.replace(self.model, attention_every=attention)
            self.flops_of[attention, size] = flops_of(family, size, self.counts)
        return self.flops_of[attention, size]

    def remarks(self) -> list[str]:
        said = [self.law_said] if self.law_said else []
        if self.cut:
            said.append(f"measuring stopped at the recipe's share of the budget ({RECIPE_SHARE:.0%}, "
                        f"{self.allowance:.1f} s): {'; '.join(self.cut)}")
        if self.device.type == "cpu" and (elsewhere := self.cores.elsewhere()) is not None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            said += [r for r in [contention(elsewhere, torch.get_num_threads(), cores)] if r]
        return said


def _sized(cfg, timing: Timing, attention: int, batch: int, train_tokens: int, val_tokens: int,
           facts: dict) -> list[Choice]:
    """The size and what follows from its passes, for the family with `attention` at `batch` rows a step."""
    budget, per_step = budget_of(cfg.train), batch * cfg.train.seq_len
    own = "model.d_model" in cfg.given or "model.n_layers" in cfg.given
    sizes = [timing.size] if own else list(LADDER)
    speeds = timing.speeds(sizes, attention, batch) if "seconds" in budget else dict.fromkeys(sizes, 1.0)
    spent = (time.perf_counter() - timing.began) / budget["seconds"] if "seconds" in budget else 0.0
    params = {size: timing.params(size) for size in sizes}
    flops = {size: timing.flops(attention, size) for size in sizes} if "flops" in budget else None
    law = timing.law if not attention else None  # (a law of the plain stack says nothing of the attended one)
    choices = choose(train_tokens, val_tokens, budget, speeds, per_step, cfg.given, spent, facts, params, flops, law)
    size = tuple(next(c.value for c in choices if c.key == key) for key in ("model.n_layers", "model.d_model")) \
        if law is not None and "seconds" in budget and not own else None
    if size and timing.measure(size, batch):  # the law's choice timed too, and chosen again on both speeds
        speeds = timing.speeds(sizes, attention, batch)
        spent = (time.perf_counter() - timing.began) / budget["seconds"]
        facts.clear()
        choices = choose(train_tokens, val_tokens, budget, speeds, per_step, cfg.given, spent, facts, params, flops,
                         law)
    return choices
