"""The default recipe: what `rpt train` chooses for the settings nobody gave (no --config, or a preset with
`train.recipe = "auto"`).

First the head: a two-level softmax's shortlist where it costs at most half a full softmax (token frequencies
of the training split). Then rank 0 times an optimiser step of one size on this machine (random tokens drawn as
often as the corpus has them, the run's batch shape), scales that speed by FLOPs to a ladder of sizes (and
times the size it picks), reads the corpus's training tokens, and from the budget derives how many passes over
the data each size would make. A corpus the budget passes over many times is over-fitted long before the
budget ends, so the recipe regularises by the passes (dropout, embedding dropout, weight drop; SGD with
momentum for AdamW; early stopping armed); a corpus larger than the budget gets none of them, and the widest
model that still sees enough tokens per parameter (width before depth). Where the chosen size makes more than
FREE_PASSES passes, compute is to spare: the family becomes the stack with sliding-window attention in every 2nd
block, and the sizes are timed again with it; under FREE_PASSES the compute is short, and steps of
COMPUTE_BOUND_BATCH rows (4 x the default's) reach a lower loss in the same time, the sizes timed again with
them (a step budget keeps its batch). A regulariser the cell does not take
(weight drop beside lstm) is left out. The periodic validation is sized to cost a small share of the budget.
Every choice is printed with its reason, written into the run's config.toml, and a key given with --set (or by
a file) is never touched.
The rules and the runs that set them: benchmarks/RESULTS.md, "Quality per second against peers" (issue 22).
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
from rpt.models.shapes import on_meta

# width before depth: each size is (n_layers, d_model)
LADDER = ((2, 128), (2, 192), (2, 256), (2, 384), (2, 512), (2, 768), (3, 1024), (4, 1536), (4, 2048))
TOKENS_PER_PARAM = 0.4  # the least training tokens per recurrent parameter a size must see within the budget
FREE_PASSES = 2.0  # passes over the data that need no regularisation; then 0.1 more strength per doubling
# each regulariser at its share of that strength (at most 0.5): the residual branches', the embedding's, the
# recurrent matrix's (lstm: the only cell with weight drop)
REGULARISERS = {"model.dropout": 1.0, "model.embed_dropout": 1.5, "model.weight_drop": 2.0}
# and, past FREE_PASSES too, SGD with momentum in place of AdamW (word_language_model's clip)
MANY_PASSES_OPTIMIZER = {"train.optimizer": "sgd", "train.lr": 1.0, "train.grad_clip": 0.25}
ATTENTION_EVERY = 2  # the family: sliding-window attention in every 2nd block of the recurrent stack
COMPUTE_BOUND_BATCH = 64  # rows a step where the budget makes under FREE_PASSES passes (4 x the default's)
HEAD_SAVING = 2.0  # a two-level softmax only where its expected cost is at most 1 / this of the full one
EVAL_SHARE = 0.025  # of the budget, for the recipe's own timing and the periodic validations together
RECIPE_SHARE = 0.05  # of a time budget: the most the recipe's measuring may take (then sizes go by FLOPs)
PROBE_LEN = 8  # tokens a row of the first, short measuring steps (a whole window's step may not fit the share)
MIN_EVAL_SHARE = 0.01  # what the validations keep however long the timing took
EVAL_TOKENS = 4096  # of a periodic validation (the whole split when that is smaller)
FORWARD_SHARE = 0.4  # a validation token's cost against a training token's (forward only, no optimiser)


# every key the recipe may choose (a key a file or --set gives is left alone); a time budget it shortens by its own time
CHOOSES = frozenset({"model.n_layers", "model.d_model", "model.head_shortlist", "model.attention_every",
                     "train.batch_size", *REGULARISERS, *MANY_PASSES_OPTIMIZER, "train.early_stop",
                     "train.eval_tokens", "train.eval_interval"})


@dataclass(frozen=True)
class Choice:
    key: str
    value: object
    why: str


def recurrent_params(n_layers: int, d_model: int) -> int:
    """An lstm stack's parameters beside the embedding: four gates over input and state per layer."""
    return n_layers * 8 * d_model * (d_model + 1)


def tokens_of(budget: dict, tokens_per_s: float, tokens_per_step: int) -> float:
    """The training tokens a budget ({"seconds"|"tokens"|"steps": n}) holds at this speed."""
    if "seconds" in budget:
        return tokens_per_s * budget["seconds"] * (1 - EVAL_SHARE)
    return budget["tokens"] if "tokens" in budget else budget["steps"] * tokens_per_step


def fits(size, budget: dict, tokens_per_s: float, tokens_per_step: int) -> bool:
    return tokens_of(budget, tokens_per_s, tokens_per_step) >= TOKENS_PER_PARAM * recurrent_params(*size)


def choose(train_tokens: int, val_tokens: int, budget: dict, speeds: dict, tokens_per_step: int,
           given: frozenset, spent: float = 0.0, facts: dict | None = None) -> list[Choice]:
    """The choices for a corpus of `train_tokens` and a budget ({"seconds"|"tokens"|"steps": n}), with
    `speeds` {(n_layers, d_model): training tokens per second on this machine}; keys in `given` are left alone.
    `spent`: the share of the budget the timing took, which the validations' share gives up. `facts`, where
    given, receives the passes over the data the chosen size makes."""
    def tokens_of_size(size) -> float:
        return tokens_of(budget, speeds[size], tokens_per_step)

    sized = "model.d_model" in given or "model.n_layers" in given
    if sized:
        size = next(iter(speeds))  # the run's own size, the one measured
    else:  # the widest that fits, or the smallest when none does
        fitting = [s for s in speeds if fits(s, budget, speeds[s], tokens_per_step)]
        size = max(fitting, key=lambda s: recurrent_params(*s)) if fitting else min(
            speeds, key=lambda s: recurrent_params(*s))
    passes = tokens_of_size(size) / max(train_tokens, 1)
    if facts is not None:
        facts["passes"] = passes
    choices = []
    if not sized:
        why = (f"the widest size that sees {TOKENS_PER_PARAM:g} token per recurrent parameter within the budget "
               f"({tokens_of_size(size):,.0f} tokens, {passes:.1f} passes over {train_tokens:,})")
        choices += [Choice("model.n_layers", size[0], why), Choice("model.d_model", size[1], why)]
    strength = min(0.5, 0.1 * math.log2(passes / FREE_PASSES)) if passes > FREE_PASSES else 0.0
    why = f"{passes:.1f} passes over the training tokens" + (
        ": over-fitting to hold back" if strength else f": none needed up to {FREE_PASSES:g}")
    for key, scale in REGULARISERS.items():
        choices.append(Choice(key, round(min(0.5, scale * strength), 2), why))
    if strength and not given & {"train.optimizer", "train.lr"}:  # a learning rate given is AdamW's or SGD's
        why = f"{passes:.1f} passes: SGD with momentum keeps generalising where AdamW over-fits after about one"
        choices += [Choice(key, value, why) for key, value in MANY_PASSES_OPTIMIZER.items()]
    choices.append(Choice("train.early_stop", 0.25 if passes > 1 else 0.0,
                          "armed: validation will stop improving before the budget ends" if passes > 1 else
                          "off: less than one pass, validation keeps improving"))
    eval_tokens = min(EVAL_TOKENS, val_tokens)
    share = max(MIN_EVAL_SHARE, EVAL_SHARE - spent)
    steps = max(1, math.ceil(eval_tokens * FORWARD_SHARE / (share * tokens_per_step)))
    why = f"a validation of {eval_tokens:,} tokens every {steps} steps costs about {share:.1%} of training"
    choices += [Choice("train.eval_tokens", eval_tokens, why), Choice("train.eval_interval", steps, why)]
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


def family_choice(cfg, passes: float) -> list[Choice]:
    """The model family for a run that makes `passes` over its data (timed without attention): where that is
    more than FREE_PASSES, the data, not the compute, limits it, and the recurrent stack spends the compute to
    spare on sliding-window attention in every ATTENTION_EVERY-th block (exact recall of the last window's
    tokens, which a fixed-size state only approximates); below, attention's cost buys less than the tokens it
    takes. Left alone where the user chose attention (or none) or the size, whose blocks it would share."""
    if {"model.attention_every", "model.n_layers", "model.d_model"} & cfg.given:
        return []
    if passes > FREE_PASSES:
        return [Choice("model.attention_every", ATTENTION_EVERY, f"{passes:.1f} passes without it: compute to "
                       f"spare, which attention every {ATTENTION_EVERY}nd block turns into better held-out text "
                       "(benchmarks/RESULTS.md, issue 44); the size is timed again with it")]
    return [Choice("model.attention_every", 0, f"{passes:.1f} passes: compute is short, and attention's cost "
                   "would buy less than the tokens it takes")]


def batch_choice(cfg, passes: float, rank_tokens: int) -> list[Choice]:
    """The rows a step for a run that makes `passes` over its data (timed at the configured batch): under
    FREE_PASSES the compute, not the data, limits it, and COMPUTE_BOUND_BATCH rows a step (4,096 tokens at the
    default window) reach a lower loss in the same time than the default's 16 (steps of less noise, and more
    tokens a second from the larger matrix products); beyond, the data limits it and the smaller batches' more
    steps are kept. Left alone where given, under a step budget (whose steps' size the user chose with it),
    where the batch would not divide into the run's micro-batches, or where a rank's `rank_tokens` are too few
    for that many streams of two windows each (the stream loader's least)."""
    if "train.batch_size" in cfg.given or "steps" in budget_of(cfg.train) or \
            COMPUTE_BOUND_BATCH % cfg.train.grad_accum or COMPUTE_BOUND_BATCH % cfg.parallel.microbatches or \
            rank_tokens <= COMPUTE_BOUND_BATCH * 2 * cfg.train.seq_len:
        return []
    if passes < FREE_PASSES:
        return [Choice("train.batch_size", COMPUTE_BOUND_BATCH, f"{passes:.1f} passes at {cfg.train.batch_size} "
                       f"rows a step: compute is short, and larger steps reach a lower loss in the same time "
                       "(benchmarks/RESULTS.md, issue 44); the size is timed again with it")]
    return [Choice("train.batch_size", cfg.train.batch_size, f"{passes:.1f} passes: the data limits the run, "
                   "and smaller batches' more steps generalise better")]


def measure_speed(cfg, size, device: torch.device, counts: np.ndarray, limit: float) -> tuple[float, bool]:
    """(training tokens per second of one size, whether measured on whole windows). Optimiser steps (forward,
    backward, AdamW) on random tokens of the run's batch shape, drawn as often as `counts` (per token id) has them
    (a two-level head's cost depends on how often the targets fall outside its shortlist): two on the first
    PROBE_LEN tokens of each row (the first pays one-time costs; the second gives a speed), then up to two on
    whole windows (the last one's speed counts), each only where that speed says it ends within `limit` s."""
    from rpt.models import RecurrentLM

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
        """One optimiser step over the first t tokens of every row; its tokens per second."""
        step_began = time.perf_counter()
        nats, _ = model(x[:, :t], targets=x[:, 1:t + 1])
        nats.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return B * t / (time.perf_counter() - step_began)

    short = min(T, PROBE_LEN)
    speed = [step(short) for _ in range(2)][-1]
    whole = False
    for _ in range(2):
        if B * T / speed > limit - (time.perf_counter() - began):
            break
        speed, whole = step(T), True
    return speed, whole


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
    return {"tokens": train.max_tokens} if train.max_tokens else {"steps": train.max_steps}


def resolve(cfg, dist_info, train_tokens: int, val_tokens: int, counts: np.ndarray) -> float:
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
        takes = get_cell(cfg.model.cell).options  # the cell options this cell does not take are left out
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
    if cfg.train.max_time:
        cfg.set("train.max_time", round(max(1.0, cfg.train.max_time - seconds), 1),
                origin=f"the budget less the default recipe's own time ({seconds:.1f} s)")
        notes.append(f"  train.max_time = {cfg.train.max_time:g}: the budget less the recipe's own time")
    cfg.notes = [*cfg.notes, *notes]
    cfg.validate()
    return seconds


def _choose_here(cfg, device, train_tokens: int, val_tokens: int, counts: np.ndarray,
                 world_size: int = 1) -> tuple[list[Choice], list]:
    """Speeds by FLOPs from one measured size (the run's own, or 2 x 256), the chosen size measured too, within
    the recipe's share of a time budget; and remarks on the measuring, where it was cut short or contended."""
    began = time.perf_counter()
    measure = type(cfg)()  # the run's settings with the data's vocabulary, for timing
    head = head_choice(cfg, counts)
    given_attention = cfg.model.attention_every if "model.attention_every" in cfg.given else 0
    measure.model = dataclasses.replace(cfg.model, **{"vocab_size": len(counts), "attention_every":
                                       given_attention, **{"head_shortlist": c.value for c in head}})
    measure.train = cfg.train
    timing = Timing(cfg.train, measure, device, counts, began)
    facts = {}
    sized = _sized(cfg, timing, train_tokens, val_tokens, facts)
    family = family_choice(cfg, facts["passes"])
    batch = batch_choice(cfg, facts["passes"], train_tokens // world_size)
    if family and family[0].value:
        measure.model = dataclasses.replace(measure.model, attention_every=family[0].value)
        sized = _sized(cfg, timing, train_tokens, val_tokens)
    elif batch and batch[0].value != cfg.train.batch_size:
        measure.train = dataclasses.replace(cfg.train, batch_size=batch[0].value)
        timing.per_step = batch[0].value * cfg.train.seq_len
        sized = _sized(cfg, timing, train_tokens, val_tokens)
    choices = family + batch + head + sized
    if cfg.comm.mode == "diloco":  # the replicas agree only at outer steps, where validations must fall
        every = cfg.comm.diloco_steps
        choices = [Choice(c.key, math.ceil(c.value / every) * every,
                          f"{c.why}; a multiple of comm.diloco_steps = {every}")
                   if c.key == "train.eval_interval" else c for c in choices]
    return choices, timing.remarks()


class Timing:
    """The recipe's measurements of sizes on this machine, all within RECIPE_SHARE of a time budget: a size is
    measured only while the measurement is expected to fit in what is left of it, and stopped where it does not."""

    def __init__(self, train, measure, device, counts: np.ndarray, began: float):
        self.measure, self.device, self.counts, self.began = measure, torch.device(device), counts, began
        self.allowance = RECIPE_SHARE * train.max_time if train.max_time else math.inf
        self.per_step = train.batch_size * train.seq_len
        self.cut: list[str] = []  # the sizes whose measurement was cut short
        self.cores = CoreUse()

    def left(self) -> float:
        return self.allowance - (time.perf_counter() - self.began)

    def speed(self, size, estimate: float | None = None) -> float | None:
        """Tokens per second of `size` measured here; `estimate` (by FLOPs) is kept, and None returned, where a
        warm-up and a timed step at that speed would not fit in what is left."""
        if estimate is not None and 2 * self.per_step / estimate > self.left():
            self.cut.append(f"{size[0]} x {size[1]} (not measured: its FLOPs' estimate kept)")
            return None
        speed, whole = measure_speed(self.measure, size, self.device, self.counts, self.left())
        if not whole:
            self.cut.append(f"{size[0]} x {size[1]} (from steps of {PROBE_LEN} tokens a row: {speed:,.0f} tokens/s)")
        return speed

    def remarks(self) -> list[str]:
        said = []
        if self.cut:
            said.append(f"measuring stopped at the recipe's share of the budget ({RECIPE_SHARE:.0%}, "
                        f"{self.allowance:.1f} s): {'; '.join(self.cut)}")
        if self.device.type == "cpu" and (elsewhere := self.cores.elsewhere()) is not None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            said += [r for r in [contention(elsewhere, torch.get_num_threads(), cores)] if r]
        return said


def _sized(cfg, timing: Timing, train_tokens: int, val_tokens: int, facts: dict | None = None) -> list:
    budget = budget_of(cfg.train)
    per_step, began = timing.per_step, timing.began
    own = (cfg.model.n_layers, cfg.model.d_model)
    if "model.d_model" in cfg.given or "model.n_layers" in cfg.given:
        speeds = {own: timing.speed(own) if "seconds" in budget else 1.0}
        return choose(train_tokens, val_tokens, budget, speeds, per_step, cfg.given, spent_since(began, budget),
                      facts)
    if "seconds" not in budget:
        return choose(train_tokens, val_tokens, budget, dict.fromkeys(LADDER, 1.0), per_step, cfg.given, 0.0, facts)
    reference = (2, 256)
    speed = timing.speed(reference)
    flops = {size: flops_of(timing.measure.model, size, timing.counts) for size in LADDER}
    speeds = {size: speed * flops[reference] / flops[size] for size in LADDER}
    picked = max([s for s in LADDER if fits(s, budget, speeds[s], per_step)] or [LADDER[0]],
                 key=lambda s: recurrent_params(*s))
    if picked != reference and (measured := timing.speed(picked, speeds[picked])) is not None:
        speeds[picked] = measured  # measured: FLOPs leave out what does not scale with them
        if not fits(picked, budget, speeds[picked], per_step):  # slower than its FLOPs said: a size smaller
            speeds = {s: v for s, v in speeds.items() if recurrent_params(*s) < recurrent_params(*picked)} or {
                picked: speeds[picked]}
    return choose(train_tokens, val_tokens, budget, speeds, per_step, cfg.given, spent_since(began, budget), facts)


def spent_since(began: float, budget: dict) -> float:
    return (time.perf_counter() - began) / budget["seconds"] if "seconds" in budget else 0.0
