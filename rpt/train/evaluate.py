"""Validation loss, perplexity and bits per byte, over the validation split (or the heads of some of its streams).

The split is scored in one fixed layout, whatever the training batch, window or world size: it is cut into
streams (`eval_streams`: at most EVAL_STREAMS contiguous streams of at least STREAM_TOKENS tokens; where documents
are marked, each cut moved to the next document start within a quarter of a stream), each read from a fresh
state with the recurrent state carried from window to window, so every token after the first is scored once,
with the same context. The batch and the window only group that computation: the data-parallel ranks take the
streams in turn, longest first, in groups of up to batch_size rows, and windows of seq_len tokens (the ends
padded, and not counted). Bits per byte = total nats / bytes / ln 2, with each target token's exact byte length,
so it compares models across tokenizers (the end-of-document token has 0 bytes). `eval_run` is `rpt eval`: a
run's checkpoint scored so, at a chosen depth for a looped model (`check_depth`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rpt.errors import RptError
from rpt.models.loop import LoopWatch, eval_depths
from rpt.train.loop_health import LoopHealth

EVAL_STREAMS = 256  # the most streams the validation split is cut into
STREAM_TOKENS = 1024  # the fewest tokens a stream holds: a shorter split is cut into fewer
HEAD_TOKENS = 256  # a periodic validation's tokens of each stream it reads
AT_LEAST_EVERY = 1 / 3  # under a time budget, the largest share of it between two periodic validations


def eval_streams(tokens, eot_id: int | None, max_tokens: int = 0) -> np.ndarray:
    """[S, 2]: each stream's first and end input position (stream s reads tokens[a:b] and predicts tokens[a+1:b+1]).
    `eot_id`: where documents are marked, each cut moves to the next document start within a quarter of a stream;
    `max_tokens`: a periodic validation's share: the first max_tokens / P tokens of P streams spread evenly over
    the S (P = max_tokens / HEAD_TOKENS, at most S)."""
    n = len(tokens) - 1  # the targets
    count = max(1, min(EVAL_STREAMS, n // STREAM_TOKENS))
    cuts = [i * n // count for i in range(count + 1)]
    if eot_id is not None:  # (within a quarter of a stream: lengths stay within that of each other)
        for i in range(1, count):
            cuts[i] = next_document_start(tokens, eot_id, cuts[i], cuts[i] + (cuts[i + 1] - cuts[i]) // 4)
    streams = np.array(list(zip(cuts[:-1], cuts[1:])), dtype=np.int64).reshape(-1, 2)
    if max_tokens:
        read = max(1, min(count, max_tokens // HEAD_TOKENS))
        streams = streams[np.arange(read) * count // read]
        streams[:, 1] = np.minimum(streams[:, 1], streams[:, 0] + max(1, max_tokens // read))
    return streams


def next_document_start(tokens, eot_id: int, begin: int, end: int, chunk: int = 1 << 16) -> int:
    """The first position in [begin, end) that holds the end-of-text token (which opens a document); `begin`
    where there is none."""
    for at in range(begin, end, chunk):
        found = np.flatnonzero(np.asarray(tokens[at:min(end, at + chunk)]) == eot_id)
        if len(found):
            return at + int(found[0])
    return begin


def forward_tokens(batch_size: int, seq_len: int, vocab_size: int) -> int:
    """Tokens an evaluation forward may take: at least the training batch's, and up to FORWARD_LOGITS_BYTES of float32
    logits, at most FORWARD_TOKENS. The state is carried from window to window, so a longer window changes no score
    (within float rounding), only how many forwards the split takes (tiny-cpu's 4 x 32 batch took 1,700); more
    logits than that budget ran slower, not faster, on the build machine (benchmarks/results/training.md)."""
    return max(batch_size * seq_len, min(FORWARD_TOKENS, FORWARD_LOGITS_BYTES // (4 * max(1, vocab_size))))


FORWARD_TOKENS = 16384
FORWARD_LOGITS_BYTES = 128 << 20


def forward_shape(streams: np.ndarray, per_rank: int, batch_size: int, seq_len: int,
                  tokens_per_forward: int) -> tuple[int, int]:
    """(rows, window) of an evaluation's forwards: `batch_size` rows of `seq_len`; given `tokens_per_forward`, a
    window of whole multiples of `seq_len` (the shapes training ran: context parallelism cuts a window in equal
    pieces) up to the longest stream, then as many rows as the tokens allow. The rows are spread evenly over the
    groups the rank's streams need."""
    rows, T = batch_size, seq_len
    if tokens_per_forward:
        longest = int((streams[:, 1] - streams[:, 0]).max())
        T = seq_len * max(1, min(math.ceil(longest / seq_len), tokens_per_forward // (batch_size * seq_len)))
        rows = max(batch_size, tokens_per_forward // T)
    return math.ceil(per_rank / math.ceil(per_rank / rows)), T


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, byte_lengths: np.ndarray, *, batch_size: int, seq_len: int,
             device: torch.device, rank: int = 0, world_size: int = 1, max_tokens: int = 0,
             eot_id: int | None = None, autocast=nullcontext, depth: int | None = None,
             by_position: bool = False, tokens_per_forward: int = 0, progress=None) -> dict:
    """The split's score in the fixed layout (`eval_streams`); up to `batch_size` rows a forward, in windows of
    `seq_len` tokens or, given `tokens_per_forward`, windows as long as that allows (at most a stream) and then
    as many rows. `depth`: a looped
    model's iterations (its default, loop_mean, where None); `by_position`: also bits per byte by the target's
    position in its document (bins of POSITION_EDGES); `progress(done, total)`: called after every forward with
    this rank's targets scored and to score."""
    was_training = model.training
    model.eval()
    check_fits(len(tokens))
    streams = eval_streams(tokens, eot_id, max_tokens)
    per_rank = math.ceil(len(streams) / world_size)
    B, T = forward_shape(streams, per_rank, batch_size, seq_len, tokens_per_forward)
    groups = math.ceil(per_rank / B)
    # the longest first, dealt out in turn: each rank's group g holds rows of about one length, the same for
    # every rank, and runs as many windows as the longest of them (every rank the same count: the pipeline's and
    # FSDP's collectives); padding rows are empty streams
    dealt = np.zeros((groups * B * world_size, 2), dtype=np.int64)
    dealt[:len(streams)] = streams[np.argsort(streams[:, 0] - streams[:, 1], kind="stable")]
    windows = [math.ceil(int(dealt[g * B * world_size, 1] - dealt[g * B * world_size, 0]) / T) for g in range(groups)]
    lengths = torch.from_numpy(byte_lengths.astype(np.int64))
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, bytes, tokens
    bins = len(POSITION_EDGES) + 1
    binned = torch.zeros(3, bins, dtype=torch.float64)  # nats, bytes, tokens by position bin
    mine = dealt[rank::world_size]
    total, done = int((mine[:, 1] - mine[:, 0]).sum()), 0
    for rows, group_windows in zip(dealt[rank::world_size].reshape(groups, B, 2), windows):
        state = None
        # each row's position before its window: unknown (below 1) until its first document start, where documents
        # are marked; from the stream's start where they are not
        carried = torch.full((B,), 0 if eot_id is None else -2 ** 40, dtype=torch.long)
        for k in range(group_windows):
            offsets = k * T + np.arange(T + 1)
            at = np.minimum(rows[:, :1] + offsets, len(tokens) - 1)
            window = torch.from_numpy(np.asarray(tokens[at]).astype(np.int64))
            valid = torch.from_numpy(offsets[None, :-1] < (rows[:, 1:] - rows[:, :1]))  # [B, T]: not padding
            x, y = window[:, :-1], window[:, 1:]
            reset = (x == eot_id) if eot_id is not None else None
            with autocast():
                losses, state = model(x.to(device), state, None if reset is None else reset.to(device),
                                      y.to(device), **({} if depth is None else {"depth": depth}))
            done += int(valid.sum())
            if progress is not None:
                progress(done, total)
            if losses is None:  # a pipeline stage before the last: it passed its activations on
                continue
            nats = losses.double() * valid.to(device)
            byte_count = (lengths[y] * valid).double()
            sums += torch.stack([nats.sum(), byte_count.sum().to(device),
                                 valid.sum().double().to(device)])
            if by_position:
                position = positions(x, eot_id, carried)
                carried = position[:, -1]
                known = (position >= 1) & valid
                where = torch.bucketize(position[known], torch.tensor(POSITION_EDGES))
                for row, values in enumerate((nats.cpu()[known], byte_count[known],
                                              torch.ones(int(known.sum()), dtype=torch.float64))):
                    binned[row].index_add_(0, where, values)
    counts = torch.cat([sums, binned.flatten().to(device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)  # over every rank: pipeline stages without logits add zeros
    total_nats, total_bytes, total_tokens = counts[:3].tolist()
    model.train(was_training)
    loss = total_nats / total_tokens
    result = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": total_nats / max(total_bytes, 1.0) / math.log(2),
              "tokens": int(total_tokens), "bytes": int(total_bytes)}
    if by_position:
        b_nats, b_bytes, b_tokens = counts[3:].view(3, bins).tolist()
        lows = [1] + [e + 1 for e in POSITION_EDGES]
        highs = [*POSITION_EDGES, None]
        result["by_position"] = [{"from": lo, "to": hi, "tokens": int(t), "bytes": int(b),
                                  "bpb": n / b / math.log(2) if b else None}
                                 for lo, hi, n, b, t in zip(lows, highs, b_nats, b_bytes, b_tokens)]
    return result


POSITION_EDGES = (64, 256, 1024, 4096)  # the last positions of the bins 1-64, 65-256, ...; then beyond 4,096


def positions(x: torch.Tensor, eot_id: int | None, carried: torch.Tensor) -> torch.Tensor:
    """Each target's position in its document ([B, T]: 1 for a document's first token, which follows its
    end-of-text token), from the tokens x [B, T] and each row's position before the window."""
    t = torch.arange(x.shape[1])
    after = carried[:, None] + t + 1
    if eot_id is None:
        return after
    start = torch.where(x == eot_id, t, -1).cummax(1).values  # the latest document start at or before t
    return torch.where(start >= 0, t - start + 1, after)


def check_fits(n: int, least: int = 2) -> None:
    """Refuse a validation split with nothing to predict (fewer than two tokens), or fewer than `least` tokens
    (train.min_val_tokens: fewer give a figure that is noise, and checkpoints ranked by it)."""
    if n < 2:
        raise RptError(f"the validation split holds {n} token(s): nothing to predict",
                       "prepare with a larger --val-fraction (rpt prepare), or more text")
    if n < least:
        raise RptError(f"the validation split holds {n:,} tokens, too few for a meaningful validation figure "
                       f"(train.min_val_tokens = {least:,}): its losses would rank checkpoints by noise",
                       "prepare the data again with a larger --val-fraction (rpt prepare --val-fraction 0.05), or "
                       "with more text; or, to go on with it, --set train.min_val_tokens=0 (every figure then says "
                       "how many tokens it rests on)")


class EvalProgress:
    """A long evaluation's progress, a line every `every` seconds (tokens scored of the total, the time so far
    and to go), so that a final evaluation of minutes is never silent. Called after each forward with this rank's
    counts (ranks score alike shares)."""

    EVERY = 10.0

    def __init__(self, say, label: str, every: float = EVERY):
        self.say, self.label, self.every = say, label, every
        self.began = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every or done >= total:
            return
        self.last, spent = now, now - self.began
        left = spent * (total - done) / max(done, 1)
        self.say(f"{self.label}: {done:,} of {total:,} tokens ({done / total:.0%}) in {spent:.0f} s, "
                 f"about {left:.0f} s to go")


class Evaluation:
    """The train section's evaluations: periodic ones every `eval_interval` steps over the first `eval_tokens`
    of the split (what checkpoints are ranked by), and the final one over the whole split. Holds the last
    periodic result, which a checkpoint keeps, and the best: with `select_best` a copy of this rank's weights at
    it (on the CPU), which the run ends with; with `early_stop` the run ends once no periodic result has
    improved on the best for that share of the budget."""

    def __init__(self, cfg, data, byte_lengths: np.ndarray, device: torch.device, rank: int, world_size: int,
                 reset_at_documents: bool, autocast):
        self.cfg, self.data, self.byte_lengths, self.device = cfg, data, byte_lengths, device
        self.rank, self.world_size, self.autocast = rank, world_size, autocast
        self.eot_id = data.eot_id if reset_at_documents else None
        self.last: dict | None = None  # the last periodic evaluation, with its step
        self.best: dict | None = None  # the best periodic evaluation, with its step and the budget spent then
        self.best_weights: dict | None = None  # this rank's weights at `best`, while this process holds them
        self.seconds = 0.0  # spent in periodic evaluations
        self.stale: str | None = None  # why the run stops early (train.early_stop), decided at each validation
        self.health = LoopHealth(cfg.loop_ignored_after)  # a looped model's failures, warned about once each
        self.warnings: list[str] = []  # what the last periodic validation calls for, until taken
        check_fits(len(data.tokens("val")), cfg.min_val_tokens)  # before step 1, not after the budget
        self.final_seconds = 0.0  # the final evaluation's, once run

    def should_evaluate(self, step: int, progress: float, align: int = 1) -> bool:
        """Every eval_interval steps; and under a time budget (whose steps depend on the machine's pace) at least
        every AT_LEAST_EVERY of the budget (`progress`, its spent share) since the last validation, at a step that
        is a multiple of `align` (DiLoCo's outer steps), so that a slower machine than expected still validates."""
        if not self.cfg.eval_interval:
            return False
        if step % self.cfg.eval_interval == 0:
            return True
        since = progress - (self.last["progress"] if self.last else 0.0)
        return bool(self.cfg.max_time) and since >= AT_LEAST_EVERY and step % align == 0

    def final_scope(self) -> str:
        """What the final evaluation reads, in words."""
        split = len(self.data.tokens("val"))
        bound = self.cfg.final_eval_tokens
        if bound and bound < split:
            return f"the heads of its streams, {bound:,} of the split's {split:,} tokens (train.final_eval_tokens)"
        return f"the whole split, {split:,} tokens"

    def run(self, model, step: int, final: bool, say=None) -> dict:
        """A validation of `model`; a looped one's also at each of its evaluation depths (`by_depth`: loss and bpb
        by depth) with what its state did at its default depth (`loop`: rpt.models.loop.LoopWatch). `say`: where a
        final evaluation tells its start and progress (EvalProgress)."""
        began = time.perf_counter()
        progress = None
        if final and say is not None:
            say(f"final evaluation: {self.final_scope()}")
            progress = EvalProgress(say, "final evaluation")
        tokens_per_forward = forward_tokens(self.cfg.batch_size, self.cfg.seq_len, len(self.byte_lengths))
        measure = lambda depth=None: evaluate(  # noqa: E731
            model, self.data.tokens("val"), self.byte_lengths, batch_size=self.cfg.batch_size, seq_len=self.cfg.seq_len,
            device=self.device, rank=self.rank, world_size=self.world_size,
            max_tokens=self.cfg.final_eval_tokens if final else self.cfg.eval_tokens, eot_id=self.eot_id,
            autocast=self.autocast, depth=depth, by_position=self.cfg.eval_by_position and depth is None,
            tokens_per_forward=tokens_per_forward, progress=progress)
        loop = getattr(model, "loop", None)  # a pipeline rank whose stages hold no core has none
        if loop is not None:
            loop.watch = LoopWatch()
        try:
            result = measure()
        finally:
            watch = loop.watch if loop is not None else None
            if loop is not None:
                loop.watch = None
        if model.cfg.loop_core:  # every rank alike: the depths' evaluations are collectives
            default = round(model.cfg.loop_mean)
            depths = eval_depths(model.cfg, self.cfg.eval_depths)
            by_depth = {d: (result if d == default else measure(d)) for d in depths}
            result = {**result, "by_depth": {d: {"loss": r["loss"], "bpb": r["bpb"]} for d, r in by_depth.items()},
                      "depth": default, "loop": watch.summary() if watch is not None else None}
        if not final:
            self.last = {**result, "step": step}
            self.seconds += time.perf_counter() - began
        else:
            self.final_seconds += time.perf_counter() - began
            bound = self.cfg.final_eval_tokens
            result["scope"] = (f"bounded by train.final_eval_tokens = {bound:,}" if bound and bound < len(
                self.data.tokens("val")) else "whole split")
        return result

    def keep_if_best(self, weights_of, progress: float) -> None:
        """After a periodic evaluation: if it is the best so far, remember it (and, selecting, the weights that
        `weights_of()` gives). Every rank decides alike: the losses are all-reduced."""
        self.last["progress"] = progress
        self.warnings += self.health.check(self.last, progress)
        if self.best is None or self.last["loss"] < self.best["loss"]:
            self.best = dict(self.last)
            self.best_weights = weights_of() if self.cfg.select_best else None
        self.stale = self._staleness()

    def _staleness(self) -> str | None:
        """Why the run stops early, or None: the periodic validations over the last `early_stop` of the budget
        (the last one that share after the best) found nothing better than the best."""
        if not self.cfg.early_stop or self.best is None:
            return None
        if self.last["progress"] - self.best["progress"] < self.cfg.early_stop - 1e-9:
            return None
        return (f"train.early_stop = {self.cfg.early_stop:g}: no better validation for that share of the budget "
                f"(the best at step {self.best['step']:,}, loss {self.best['loss']:.4f})")

    def rescale_progress(self, factor: float) -> None:
        """A resume under another budget: the kept validations' shares of the old budget become shares of the new."""
        for record in (self.last, self.best):
            if record is not None and "progress" in record:
                record["progress"] *= factor
        self.stale = self._staleness()

    def restart_patience(self, progress: float) -> None:
        """An early-stopped run extended: the early stop's patience starts afresh at `progress` (the best so far
        counts as found there)."""
        for record in (self.last, self.best):
            if record is not None:
                record["progress"] = progress
        self.stale = None

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings

    def ranking(self, step: int) -> tuple[float, int] | None:
        """(loss, tokens) of the periodic evaluation of `step`, what its checkpoint is ranked by; None if none."""
        return (self.last["loss"], self.last["tokens"]) if self.last and self.last["step"] == step else None

    def state_dict(self) -> dict:
        return {"last": self.last, "best": self.best, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.last = state["last"]
        self.best, self.seconds = state.get("best"), state.get("seconds", 0.0)  # older checkpoints: none yet
        self.stale = self._staleness()


def eval_run(run_dir: str, checkpoint: str, device: str | None, data_path: str | None,
             depth: int | None = None, by_position: bool = False) -> dict:
    """Validation of a run's checkpoint (a looped model at `depth` iterations, its loop_mean where None; with
    `by_position`, also by the position of each token in its document)."""
    from rpt.data.dataset import PreparedData
    from rpt.data.mixture import open_dataset
    from rpt.data.tokenizer import token_byte_lengths
    from rpt.parallel.runner import autocast_for
    from rpt.runtime.memory import keep_freed_memory
    from rpt.train.run_dir import load_run

    keep_freed_memory()
    cfg, model, tokenizer, path, ck = load_run(run_dir, checkpoint, device)
    depth = check_depth(cfg.model, depth)
    if cfg.train.bptt_chunk:  # a long window's losses a chunk at a time, as its validations computed them
        from rpt.parallel.bptt import chunk_windows

        chunk_windows(model, cfg.train.bptt_chunk)
    data = PreparedData(data_path) if data_path else open_dataset(cfg.data)
    if data.meta["tokenizer_sha256"] != json.loads((Path(run_dir) / "meta.json").read_text())["tokenizer_sha256"]:
        raise RptError(f"the data at {data.path} was tokenized with another tokenizer than the run's",
                       "evaluate on data prepared with the run's tokenizer (rpt prepare --tokenizer RUN_DIR/tokenizer.json)")
    dev = next(model.parameters()).device
    lengths = token_byte_lengths(tokenizer)
    result = evaluate(model, data.tokens("val"), lengths, batch_size=cfg.train.batch_size,
                      seq_len=cfg.train.seq_len, device=dev,
                      autocast=partial(autocast_for, cfg.train.precision, dev),  # as the run's own evaluations
                      eot_id=data.eot_id if cfg.data.reset_at_documents else None, depth=depth,
                      by_position=by_position,
                      tokens_per_forward=forward_tokens(cfg.train.batch_size, cfg.train.seq_len, len(lengths)),
                      progress=EvalProgress(lambda line: print(line, file=sys.stderr, flush=True), "evaluating"))
    about = ck.describe(path)
    return {**result, "depth": depth, "checkpoint": path, "about": f"{checkpoint}: {about}" if checkpoint in ("best", "latest") else about}


def check_depth(m, depth: int | None) -> int | None:
    """The test-time depth of a looped model: `depth`, or its loop_mean (rounded) where None; refused for a model
    without a loop, below 1, and above DEPTH_FACTOR x the most it trained at."""
    if depth is None:
        return round(m.loop_mean) if m.loop_core else None
    if not m.loop_core:
        raise RptError(f"--depth {depth} for a model without a loop (model.loop_core = 0)",
                       "leave out --depth: only a looped model (docs/depth.md) runs at a chosen depth")
    if depth < 1:
        raise RptError(f"--depth {depth}: a looped model runs its core at least once",
                       f"use --depth 1 or more (its training mean was {m.loop_mean:g})")
    if depth > DEPTH_FACTOR * m.loop_cap:
        raise RptError(f"--depth {depth:,}: more than {DEPTH_FACTOR} x the most iterations the model trained at "
                       f"(model.loop_max = {m.loop_cap}); each costs a pass of the core a token, and each one beyond "
                       f"{m.loop_cap} a state of its own", f"use --depth {DEPTH_FACTOR * m.loop_cap} or less (its "
                       f"training mean was {m.loop_mean:g}; a looped model's gains end well before)")
    return depth


DEPTH_FACTOR = 4  # the deepest test-time depth: this many times the most iterations the model trained at (loop_max)
