"""Typed run configuration: dataclass sections, TOML files, `--set section.key=value` overrides.

A run is fully described by one `Config`: defaults, then a TOML file from `configs/`, then
repeated `--set` overrides, then `validate()`. Every value goes through one coercion routine,
so a TOML file and the command line accept and refuse the same things. Mistakes fail fast
with one message that names the fix: an unknown key names the closest valid one, a wrong type
names the expected type, an impossible combination says what to change.

The resolved configuration is written into the run directory (rpt/train/resolve.py: each value's origin in a
comment), so every run can be reproduced from its own folder with `--config RUN_DIR/config.toml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rpt.errors import RptError


class Frozen(RptError):
    """A change to a configuration after it was resolved: nothing may change a run's settings from there on."""


class _Section:
    """A section that refuses changes once frozen (`Config.freeze`)."""
    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise Frozen(f"the configuration is frozen: {type(self).__name__}.{name} cannot change",
                         "change it before the run resolves it (a --set, or Config.load's overrides), or resolve "
                         "another configuration (rpt.train.resolve)")
        super().__setattr__(name, value)


@dataclass
class DataConfig(_Section):
    """Where the prepared tokens are (the folder `rpt prepare --out` wrote) and how they are read."""

    path: str = "data/stdlib"
    # "stream": B contiguous streams per rank, batch k+1 continues batch k (truncated BPTT).
    # "random": windows at random offsets, nanoGPT style, for stateless training.
    loader: Literal["stream", "random"] = "stream"
    # Reset the recurrent state where a document starts (the end-of-document token).
    reset_at_documents: bool = True
    # A mixture instead of data.path: prepared folders (one tokenizer) and their weights, e.g.
    # {"data/web" = 0.7, "data/code" = 0.3}; each row of a batch is drawn from one of them by weight (data.path is
    # then not read; docs/data.md "Mixtures")
    mix: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        if not self.path:
            raise RptError("data.path is empty", "point it at a folder written by `rpt prepare --out FOLDER`")
        for folder, weight in self.mix.items():
            if not weight > 0:
                raise RptError(f"data.mix gives {folder} the weight {weight}: weights must be positive",
                               f"remove {folder} from data.mix to leave it out, or give it a weight above 0")
        if len(self.mix) == 1:
            raise RptError("data.mix names one folder", "set data.path to it instead, or add the other folders")


@dataclass
class ModelConfig(_Section):
    """The recurrent language model (rpt/models). `vocab_size = 0` takes the vocabulary of the data."""

    cell: str = "lstm"  # lstm, gru, modlstm, mingru, minlstm, mlstm, gdn, or one registered with register_cell
    n_layers: int = 2
    d_model: int = 256
    d_hidden: int = 0  # the cell's state width; 0: the cell's default (d_model, or 2 x d_model for mingru/minlstm)
    vocab_size: int = 0
    dropout: float = 0.0  # on every block's residual branches
    # On the embedding matrix's two uses: the token vectors going into the first block and the hidden state going
    # to the (tied) head, as word_language_model and AWD-LSTM drop their input and output.
    embed_dropout: float = 0.0
    weight_drop: float = 0.0  # DropConnect on the recurrent matrix (lstm): one mask per sequence, AWD-LSTM's
    tie_embeddings: bool = True
    # 0: a softmax over the whole vocabulary. S: a two-level softmax, the S most frequent training tokens and one
    # entry for the rest in the first, the rest in the second (`ClusteredHead`, rpt/models/heads.py): exact, and
    # about a third of the cost where the S cover most of the text
    head_shortlist: int = 0
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    mlp_ratio: float = 0.0  # gated MLP sub-layer of this width ratio in every block; 0: none
    attention_every: int = 0  # causal sliding-window attention sub-layer in every k-th block; 0: none
    attention_window: int = 128
    attention_heads: int = 4
    weight_norm: bool = False  # weight normalisation of the cells' projection matrices
    # Recompute each block in backward instead of keeping its activations: a block keeps only its input
    # (d_model numbers per token), for about a third more compute. Results are unchanged (dropout replays).
    activation_checkpointing: bool = False
    # The modified LSTM (cell = "modlstm"); forget_bias applies to lstm too.
    gate: str = "sigmoid"  # sigmoid, hard_sigmoid, exp (xLSTM-style, stabilised), or one registered with register_gate
    gate_norm: bool = False
    coupled_gates: bool = False
    forget_bias: Union[float, Literal["auto"]] = "auto"  # "auto": the gate's own (+1 sigmoid-like, -1 for exp)
    peepholes: bool = False
    # lstm, gru, modlstm: a block-diagonal recurrent matrix of this many heads (xLSTM's sLSTM layout): each head's
    # d_hidden / heads state units read only their own head's state; fewer parameters and FLOPs. mlstm, gdn: their
    # heads, each a [d_hidden / heads]^2 matrix memory
    heads: int = 1
    chunk_size: int = 64  # mlstm, gdn: the chunkwise form's chunk (steps computed together as attention computes them)
    # Depth recurrence (rpt/models/loop.py): blocks [0, loop_prelude) run once, the next loop_core blocks (the core)
    # run r times with the prelude's output injected at each iteration, the remaining blocks (the coda) once. r is
    # drawn per training step from (train.seed, step), the same on every rank; only the last loop_backprop
    # iterations keep gradients. At evaluation and generation r is the test-time depth (loop_mean unless given).
    loop_prelude: int = 0
    loop_core: int = 0  # 0: no loop (the model is what it was without these keys)
    loop_mean: float = 4.0  # the mean r drawn in training (with loop_sampler "fixed": r itself)
    loop_backprop: int = 2  # k: iterations that keep gradients (the first r - k run without)
    loop_max: int = 0  # a cap on the drawn r, and the iterations whose state training carries; 0: 4 x loop_mean
    loop_sampler: Literal["poisson-lognormal", "fixed", "uniform"] = "poisson-lognormal"
    # The prelude's output into each iteration: h + e, or "linear", adapter(cat(h, e)) as Huginn (0.056 bpb worse in
    # benchmarks/depth/curve.py at equal time, benchmarks/results/depth.md)
    loop_inject: Literal["add", "linear"] = "add"
    # The iterations' first state: zero (validation deterministic, every layout equal to one process), or random
    # (truncated normal, std 0.63, drawn at each forward, as Huginn trains)
    loop_init: Literal["zero", "random"] = "zero"
    imports: list[str] = field(default_factory=list)  # modules to import first (they may register cells and gates)

    @property
    def loop_cap(self) -> int:
        """The most iterations a training step draws (loop_max, or 4 x loop_mean where it is 0)."""
        return self.loop_max or max(1, math.ceil(4 * self.loop_mean))

    def check(self) -> None:
        """This section's own values (the cell's options are the registry's: rpt.models.registry.check_names)."""
        _positive("model.n_layers", self.n_layers)
        _positive("model.d_model", self.d_model)
        _positive("model.heads", self.heads)
        for name in ("vocab_size", "d_hidden", "mlp_ratio", "attention_every", "head_shortlist"):
            _non_negative(f"model.{name}", getattr(self, name))
        if self.attention_every:
            _positive("model.attention_window", self.attention_window)
            _positive("model.attention_heads", self.attention_heads)
            if self.d_model % self.attention_heads:
                raise RptError(f"model.d_model = {self.d_model} is not divisible by model.attention_heads = "
                               f"{self.attention_heads}", "choose a head count that divides d_model")
        if self.vocab_size and self.head_shortlist >= self.vocab_size:
            raise RptError(f"model.head_shortlist = {self.head_shortlist} is not below the vocabulary "
                           f"({self.vocab_size})", "use a shortlist of about a tenth of the vocabulary, or 0 for none")
        for name in ("dropout", "embed_dropout", "weight_drop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise RptError(f"model.{name} = {getattr(self, name)} is outside [0, 1)",
                               "use a value such as 0.1, or 0 for none")
        if self.loop_core:
            self._check_loop()
        else:
            self._no_loop()

    def _no_loop(self) -> None:
        """Loop options without a loop would be ignored (a plain model trains): refused."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("loop_")}
        set_ = [f"model.{k} = {getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v]
        if set_:
            raise RptError(f"{', '.join(set_)} without model.loop_core: a model without a loop would ignore "
                           f"{'it' if len(set_) == 1 else 'them'}", "set model.loop_core to the number of blocks to "
                           "loop (docs/depth.md), or leave the loop options out")

    def _check_loop(self) -> None:
        for name in ("loop_prelude", "loop_core", "loop_max"):
            _non_negative(f"model.{name}", getattr(self, name))
        _positive("model.loop_backprop", self.loop_backprop)
        if self.loop_prelude + self.loop_core > self.n_layers:
            raise RptError(f"model.loop_prelude + loop_core = {self.loop_prelude + self.loop_core} is more than "
                           f"model.n_layers = {self.n_layers} (the coda is the blocks after them)",
                           f"use loop_prelude + loop_core <= {self.n_layers}, or more layers")
        poisson = self.loop_sampler == "poisson-lognormal"
        if self.loop_mean < 1 or (poisson and self.loop_mean <= 1):
            raise RptError(f"model.loop_mean = {self.loop_mean} is " + (
                "not above 1: the Poisson-lognormal draw is 1 + Poisson(l) with a mean l = loop_mean - 1 > 0" if poisson
                else "below 1: the core runs at least once"),
                f"use a mean such as {min(4, self.loop_max) if self.loop_max > 1 else 4}" +
                (", or loop_sampler = 'fixed' for one depth" if poisson else ""))
        if self.loop_mean > self.loop_cap:
            raise RptError(f"model.loop_mean = {self.loop_mean} is above the cap on the depth, model.loop_max = "
                           f"{self.loop_max}", f"use loop_mean <= {self.loop_max}, or loop_max = 0 (4 x loop_mean) "
                           f"or above {self.loop_mean:g}")
        if self.loop_backprop > self.loop_cap:
            raise RptError(f"model.loop_backprop = {self.loop_backprop} is above the cap on the depth "
                           f"(loop_max = {self.loop_cap})", f"use loop_backprop <= {self.loop_cap}, or a larger loop_max")


@dataclass
class TrainConfig(_Section):
    """The optimisation loop. Budgets of 0 mean "no limit"; the first budget reached ends the run."""

    seed: int = 0
    batch_size: int = 16
    seq_len: int = 64
    # Exact BPTT over the window in chunks of this many tokens, each recomputed in backward from its boundary
    # state (rpt/parallel/bptt.py): memory of one chunk, gradients of the whole window; 0: the plain backward
    bptt_chunk: int = 0
    max_steps: int = 1000
    max_tokens: int = 0
    max_time: float = 0.0
    # training FLOPs (model.flops_per_token x tokens: forward and backward): a budget alike on every machine, the
    # axis `rpt scaling` measures the compute-optimal frontier on
    max_flops: float = 0.0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.1  # AdamW's (decoupled); SGD runs without one
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's
    momentum: float = 0.9  # SGD's (heavy ball)
    grad_clip: float = 1.0
    grad_accum: int = 1
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    eval_interval: int = 200  # steps between validations; 0: only at the end
    eval_tokens: int = 0  # tokens of a periodic validation; 0: the whole split
    final_eval_tokens: int = 0  # tokens of the final evaluation (the heads of its streams, as eval_tokens); 0: all
    # A validation split of fewer tokens is refused at start (its figures would be noise); 0 goes on with any, each
    # figure saying how many tokens it rests on
    min_val_tokens: int = 1024
    eval_by_position: bool = False  # validations also report bits per byte by position in the documents
    # A looped model's validations also run at these depths (one pass each; its checkpoints are ranked at
    # model.loop_mean); empty: 1, 2, 4, loop_mean, 2 x and 4 x loop_mean
    eval_depths: list[int] = field(default_factory=list)
    # After this share of the budget, a looped model's validation at loop_mean that is not better than at depth 1
    # is warned about: the loop is being ignored
    loop_ignored_after: float = 0.25
    # Selection by validation: the run's result (its final evaluation, the checkpoint `best`) is the weights of its
    # best periodic validation; and the run ends early once none improved on the best for this share of its budget.
    select_best: bool = True
    early_stop: float = 0.25  # 0: never
    # Polyak averaging: the run's weights become the mean of the weights after every step of the last this share of
    # the budget (validated, selected and checkpointed as the model; rpt/train/averaging.py); 0: none
    average: float = 0.0
    # "auto": the default recipe (rpt/train/recipe.py) chooses the settings no file or --set gave; `rpt train`
    # without --config runs it
    recipe: Literal["fixed", "auto"] = "fixed"
    max_bad_steps: int = 25  # stop after this many optimiser steps in a row with non-finite gradients
    stall_timeout: float = 300.0  # seconds a rank may wait in one phase while others are elsewhere; 0: off
    compile: str = ""  # torch.compile backend for each block ("inductor", ...); "": eager
    # Start from earlier weights (a run directory, one of its checkpoints, or an `rpt export` folder), with a fresh
    # optimiser, schedule and loader; init_fresh: the parts left at their fresh initialisation ("embed", "head")
    init_from: str = ""
    init_fresh: list[str] = field(default_factory=list)

    def check(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "max_bad_steps"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("max_steps", "max_tokens", "max_time", "max_flops", "warmup_steps", "stall_timeout", "eval_interval",
                     "eval_tokens", "final_eval_tokens", "min_val_tokens", "grad_clip", "weight_decay"):
            _non_negative(f"train.{name}", getattr(self, name))
        _non_negative("train.bptt_chunk", self.bptt_chunk)
        if self.bptt_chunk and self.seq_len % self.bptt_chunk:
            divisors = [c for c in range(1, self.seq_len + 1) if self.seq_len % c == 0 and c <= self.bptt_chunk]
            raise RptError(f"train.bptt_chunk = {self.bptt_chunk} does not divide train.seq_len = {self.seq_len}",
                           f"use a chunk that divides the window, e.g. train.bptt_chunk = {divisors[-1]}")
        if self.batch_size % self.grad_accum:
            raise RptError(f"train.batch_size = {self.batch_size} is not divisible by train.grad_accum = "
                           f"{self.grad_accum}", "the batch is split into grad_accum equal micro-batches; choose a divisor")
        if self.lr <= 0:
            raise RptError(f"train.lr = {self.lr} must be positive", "a typical value is 3e-3 for small recurrent models")
        if any(d < 1 for d in self.eval_depths):
            raise RptError(f"train.eval_depths = {self.eval_depths}: a looped model runs its core at least once",
                           "use depths of 1 or more, e.g. [1, 2, 4, 8]")
        if not 0.0 <= self.loop_ignored_after <= 1.0:
            raise RptError(f"train.loop_ignored_after = {self.loop_ignored_after} is outside [0, 1]",
                           "it is a share of the budget, e.g. 0.25")
        if not 0.0 <= self.early_stop <= 1.0:
            raise RptError(f"train.early_stop = {self.early_stop} is outside [0, 1]",
                           "it is a share of the budget, e.g. 0.25; 0 never stops early")
        if not 0.0 <= self.average < 1.0:
            raise RptError(f"train.average = {self.average} is outside [0, 1)",
                           "it is the share of the budget, at its end, over which the weights are averaged: e.g. 0.3")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise RptError(f"train.min_lr_ratio = {self.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
        if not 0.0 <= self.momentum < 1.0:
            raise RptError(f"train.momentum = {self.momentum} is outside [0, 1)", "use e.g. 0.9, or 0 for plain SGD")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise RptError(f"train.betas = {self.betas} must be two numbers in [0, 1)",
                           "e.g. --set train.betas=[0.9,0.95]")
        unknown = [p for p in self.init_fresh if p not in ("embed", "blocks", "norm", "head")]
        if unknown:
            raise RptError(f"train.init_fresh names {', '.join(map(repr, unknown))}, not a part of the model",
                           "list some of embed, blocks, norm, head, e.g. [\"head\"]")
        if self.init_fresh and not self.init_from:
            raise RptError("train.init_fresh is set without train.init_from", "set train.init_from = PATH, or drop init_fresh")
        if self.compile:
            import torch._dynamo

            if self.compile not in torch._dynamo.list_backends(exclude_tags=()):  # debug backends included
                raise RptError(f"train.compile = '{self.compile}' is not a torch.compile backend",
                               f"use 'inductor' (or one of {', '.join(torch._dynamo.list_backends())}), 'aot_eager' "
                               "to trace without generating code, or '' to run eagerly")
        if self.max_steps == 0 and self.max_tokens == 0 and self.max_time == 0 and self.max_flops == 0:
            raise RptError("train.max_steps, max_tokens, max_time and max_flops are all 0: the run would never end",
                           "set at least one budget, e.g. --set train.max_steps=1000")


@dataclass
class ParallelConfig(_Section):
    """Layer pipeline parallelism, FSDP2 sharding and context parallelism; plain data parallelism (replicas) takes
    the remaining ranks."""

    pp: Union[int, Literal["auto"]] = 1   # pipeline stages; "auto": the fewest whose memory fits (rpt plan)
    fsdp: Union[int, Literal["auto"]] = 1  # ranks that shard each stage's parameters, gradients and optimiser state
    cp: int = 1                           # context parallelism: ranks that split each window's time axis (one group
    #                                       reads the same rows; rpt/parallel/context.py)
    fsdp_reshard_microsteps: bool = False  # accumulation: reshard the parameters after every micro-step's backward
    microbatches: int = 1                 # micro-batches per step through the pipeline (batch_size divisible)
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    stages_per_rank: int = 2              # schedule "interleaved": virtual stages (block chunks) on each rank

    def check(self) -> None:
        _positive("parallel.microbatches", self.microbatches)
        _positive("parallel.cp", self.cp)
        if isinstance(self.pp, int):
            _positive("parallel.pp", self.pp)
        if isinstance(self.fsdp, int):
            _positive("parallel.fsdp", self.fsdp)
        if self.schedule == "interleaved":
            if self.fsdp != 1:
                raise RptError(f"parallel.fsdp = {self.fsdp!r} with the interleaved schedule: FSDP shards one "
                               "pipeline stage per rank", "use parallel.schedule = '1f1b' (or 'gpipe') with FSDP")
            if self.stages_per_rank < 2:
                raise RptError(f"parallel.stages_per_rank = {self.stages_per_rank} with the interleaved schedule",
                               "use 2 or more virtual stages per rank, or parallel.schedule = '1f1b'")
            if not isinstance(self.pp, int) or self.pp < 2:
                raise RptError(f"parallel.schedule = 'interleaved' with parallel.pp = {self.pp!r}",
                               "give parallel.pp >= 2 as a number: the interleaved schedule has no 'auto' plan")
            if self.microbatches % self.pp:
                raise RptError(f"parallel.microbatches = {self.microbatches} is not a multiple of parallel.pp = "
                               f"{self.pp}, which the interleaved schedule needs", f"use e.g. {2 * self.pp} micro-batches")


@dataclass
class CommConfig(_Section):
    """Gradient synchronisation across data-parallel ranks."""

    mode: Literal["allreduce", "ps", "ps-sharded", "diloco", "auto"] = "allreduce"
    compression: Literal["none", "fp16", "bf16", "int8", "powersgd", "topk"] = "none"  # int8: diloco only
    powersgd_rank: int = 4
    topk_fraction: float = 0.01
    adaptive: bool = False
    adaptive_period: int = 4       # minor groups synchronise every this many steps (accumulating locally)
    adaptive_interval: int = 50    # importance is re-ranked every this many steps (all groups sync before the first)
    adaptive_keep: float = 0.5     # share of the groups (by count) that stay important
    adaptive_pin: list[str] = field(default_factory=lambda: ["embed", "head"])  # always important (name prefixes)
    bucket_mb: float = 25.0
    diloco_steps: int = 50         # diloco: inner steps between outer steps (H)
    diloco_outer_lr: float = 0.7   # diloco: the outer SGD's learning rate
    diloco_momentum: float = 0.9   # diloco: the outer SGD's Nesterov momentum (0: none)

    def check(self) -> None:
        if self.mode == "diloco":
            _positive("comm.diloco_steps", self.diloco_steps)
            if self.diloco_outer_lr <= 0 or not 0.0 <= self.diloco_momentum < 1.0:
                raise RptError(f"comm.diloco_outer_lr = {self.diloco_outer_lr}, comm.diloco_momentum = "
                               f"{self.diloco_momentum}: the rate must be positive and the momentum in [0, 1)",
                               "DiLoCo's published values: outer lr 0.7, momentum 0.9")
            if self.compression not in ("none", "fp16", "bf16", "int8") or self.adaptive:
                raise RptError(f"comm.mode = 'diloco' with comm.compression = '{self.compression}'"
                               + (" and comm.adaptive" if self.adaptive else "") + ": DiLoCo sends the outer "
                               "step's pseudo-gradient whole, at the width the compression gives",
                               "use compression none, fp16, bf16 or int8 with diloco, and comm.adaptive = false")
        elif self.compression == "int8":
            raise RptError(f"comm.compression = 'int8' with comm.mode = '{self.mode}': int8 is DiLoCo's outer "
                           "payload; gradients every step take fp16, bf16, powersgd or topk",
                           "use comm.mode = 'diloco', or another compression")
        if self.compression == "powersgd":
            _positive("comm.powersgd_rank", self.powersgd_rank)
        if self.compression == "topk" and not 0.0 < self.topk_fraction <= 1.0:
            raise RptError(f"comm.topk_fraction = {self.topk_fraction} is outside (0, 1]",
                           "e.g. 0.01 keeps 1% of entries")
        if self.compression in ("powersgd", "topk") and self.mode in ("ps", "ps-sharded"):
            raise RptError(f"comm.compression = '{self.compression}' needs a low-rank or sparse all-reduce, "
                           f"which comm.mode = '{self.mode}' does not do",
                           "use comm.mode = 'allreduce' with it, or fp16/bf16 compression with a parameter server")
        if self.adaptive:
            _positive("comm.adaptive_period", self.adaptive_period)
            _positive("comm.adaptive_interval", self.adaptive_interval)
            if not 0.0 < self.adaptive_keep <= 1.0:
                raise RptError(f"comm.adaptive_keep = {self.adaptive_keep} is outside (0, 1]", "e.g. 0.5")
            if self.mode in ("ps", "ps-sharded") or self.compression != "none":
                raise RptError(f"comm.adaptive with comm.mode = '{self.mode}' and comm.compression = "
                               f"'{self.compression}': adaptive synchronisation runs on the all-reduce path without "
                               "a codec in this version",
                               "use comm.mode = 'allreduce' (or 'auto') and comm.compression = 'none' with it")


@dataclass
class CheckpointConfig(_Section):
    """Sharded checkpoints: every `interval` steps and every `interval_minutes` of training (0 turns either
    off), and always at the end of the run."""

    interval: int = 0
    interval_minutes: float = 15.0
    keep_last: int = 2
    keep_best: int = 1
    async_save: bool = False
    path: str = ""  # empty: RUN_DIR/checkpoints; may be a shared path or an fsspec URL

    def check(self) -> None:
        for name in ("interval", "interval_minutes", "keep_last", "keep_best"):
            _non_negative(f"checkpoint.{name}", getattr(self, name))
        if self.keep_last == 0 and self.keep_best == 0:
            raise RptError("checkpoint.keep_last = 0 and checkpoint.keep_best = 0 would delete every checkpoint, "
                           "the final one too", "keep at least the last one: checkpoint.keep_last = 1")


@dataclass
class MonitorConfig(_Section):
    """Metrics written by rank 0 and read by `rpt monitor`."""

    log_interval: int = 10
    tensorboard: Union[bool, Literal["auto"]] = "auto"  # "auto": event files in RUN_DIR/tb when tensorboard is installed
    wandb: bool = False  # a W&B run (needs wandb; WANDB_PROJECT, WANDB_MODE=offline, ... apply)
    profile: str = ""  # "START:END": torch.profiler traces of those steps on every rank (rpt train --profile)

    def check(self) -> None:
        _positive("monitor.log_interval", self.log_interval)
        if self.profile:
            first, sep, last = self.profile.partition(":")
            if not (first.isdigit() and (not sep or last.isdigit()) and 1 <= int(first) <= int(last or first)):
                raise RptError(f"monitor.profile = '{self.profile}' is not a step range START:END",
                               "e.g. --profile 10:12 profiles steps 10, 11 and 12")


@dataclass
class RecipeConfig(_Section):
    """What the default recipe (train.recipe = "auto") sizes a run from (rpt/train/recipe.py)."""

    # A scaling law (law.json, written by `rpt scaling fit`): the model's size is the one of the recipe's ladder the
    # law predicts the least loss for at the run's budget, on the passes over the data that budget makes.
    # "": the ladder's rule (the widest size that sees 0.4 training token a recurrent parameter).
    law: str = ""

    def check(self) -> None:
        if self.law and not Path(self.law).is_file():
            raise RptError(f"recipe.law = {self.law!r}: no such file",
                           "give the law.json `rpt scaling fit` wrote (or '' for the ladder's rule)")


BUDGETS = ("train.max_steps", "train.max_tokens", "train.max_time", "train.max_flops")


@dataclass
class Config(_Section):
    """Every section of a run. `Config.load` gives the user's configuration (defaults, a file, --set), checked
    section by section and frozen; rpt/train/resolve.py resolves a thawed copy against the data and the world
    (the recipe, the vocabulary, what `auto` measures), checks what spans sections, and freezes that."""
    notes: typing.ClassVar[list[str]] = []  # what loading changed on its own, said to the user at start
    given: typing.ClassVar[frozenset[str]] = frozenset()  # the keys a file or --set gave (the recipe keeps off them)
    origins: typing.ClassVar[dict[str, str]] = {}  # section.key -> where its value came from (absent: the default)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)

    # ----------------------------------------------------------------- building
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
             run_file: bool = False, implied: dict[str, tuple[Any, str]] | None = None) -> "Config":
        """Defaults, then `implied` ({section.key: (value, origin)}: what the command itself sets), then the TOML
        file at `path`, then `section.key=value` overrides, then each section's checks; frozen (a thawed() copy
        may be changed). `run_file`: `path` is a run's own config.toml (a resume), whose values keep the origins
        its comments give, and the overrides are marked as the resume's."""
        cfg = cls()
        cfg.origins = {}
        for key, (value, origin) in (implied or {}).items():
            cfg.set(key, value, origin=origin)
        in_file = []
        if path is not None:
            tree = read_toml(path)
            cfg.update(tree, origin=str(path))
            in_file = [f"{name}.{key}" for name, values in tree.items() if isinstance(values, dict) for key in values]
            if run_file:
                cfg.origins = {k: v for k, v in cfg.origins.items() if k not in in_file}
                cfg.origins.update(read_origins(path))
        given = []
        for item in overrides:
            key, value = parse_override(item)
            cfg.set(key, value, origin="--set with --resume" if run_file else "--set")
            given.append(key)
        cfg.notes = cfg._replace_budgets(given, in_file) + cfg._path_or_mix(in_file, given)
        cfg.given = frozenset(in_file + given)
        cfg.validate()
        cfg.notes += cfg._past_the_budget()
        return cfg.freeze()

    def freeze(self) -> "Config":
        """Refuse every later assignment to a value. (Lists and tables stay lists and dicts, not read-only copies:
        nothing in rpt changes them in place.)"""
        for section in (self, *(getattr(self, name) for name in _sections())):
            object.__setattr__(section, "_frozen", True)
        return self

    def thawed(self) -> "Config":
        """A copy that may be changed (its notes, given keys and origins copied too)."""
        copy = dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name)) for name in _sections()})
        for section in (copy, *(getattr(copy, name) for name in _sections())):
            section.__dict__.pop("_frozen", None)
        copy.notes, copy.given, copy.origins = list(self.notes), self.given, dict(self.origins)
        return copy

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _replace_budgets(self, given: list[str], in_file: list[str]) -> list[str]:
        """A budget given with --set replaces the budgets of the file and the defaults, so that a preset's
        max_steps cannot end a run the user gave 300 seconds; budgets given together with --set all hold. Said
        for the file's budgets (a default the user never set goes quietly)."""
        named = [key for key in BUDGETS if key in given]
        if not named:
            return []
        notes = []
        for key in BUDGETS:
            if key not in named and self.get(key):
                if key in in_file:
                    notes.append(f"{key} = {self.get(key)} is off: a budget given with --set ({', '.join(named)}) "
                                 "replaces the others (give both with --set to keep both)")
                self.set(key, 0, origin="off: a budget given with --set replaces it")
        return notes

    def _past_the_budget(self) -> list[str]:
        """Warnings for what a step budget leaves unreached: the warm-up's end, a profiled range."""
        t, steps, said = self.train, self.train.max_steps, []
        chooses_warmup = t.recipe == "auto" and "train.warmup_steps" not in self.given  # (the recipe sizes it)
        if steps and t.warmup_steps > steps and not chooses_warmup:
            said.append(f"warning: train.warmup_steps = {t.warmup_steps} is beyond train.max_steps = {steps}: the "
                        f"learning rate never reaches train.lr = {t.lr:g} (lower warmup_steps, e.g. to {steps // 10})")
        if steps and self.monitor.profile and int(self.monitor.profile.partition(":")[0]) > steps:
            said.append(f"warning: no step of the profiled range {self.monitor.profile} comes within train.max_steps = "
                        f"{steps}: nothing will be traced (choose steps up to {steps})")
        return said

    def _path_or_mix(self, in_file: list[str], given: list[str]) -> list[str]:
        """A mixture reads its own folders, never data.path: both given is refused (one would be ignored), and a
        preset's data.path that a mixture given with --set replaces is said."""
        if not self.data.mix or "data.path" not in in_file + given:
            return []
        if "data.path" in given or "data.mix" in in_file:
            raise RptError(f"data.path = {self.data.path} and data.mix are both given: a mixture reads the folders "
                           "it names, not data.path", "give one of them: drop data.path (or --set 'data.mix={}' to "
                           "train on data.path alone)")
        return [f"data.mix replaces the preset's data.path = {self.data.path} (a mixture reads its own folders)"]

    def update(self, tree: dict, origin: str) -> None:
        for section_name, section_values in tree.items():
            section = self._section(section_name, origin)
            if not isinstance(section_values, dict):
                raise RptError(f"{origin}: [{section_name}] must be a table of keys, got {section_values!r}",
                               f"write it as a section:  [{section_name}]  followed by key = value lines")
            for key, value in section_values.items():
                _set_field(section, section_name, key, value, origin)
                self._origin(f"{section_name}.{key}", origin)

    def _origin(self, key: str, origin: str) -> None:
        if "origins" not in self.__dict__:  # a Config() built in code: its own table, not the class's
            self.origins = {}
        self.origins[key] = origin

    def set(self, dotted_key: str, value: Any, origin: str = "--set") -> None:
        """Set one `section.key`; `value` may be a typed value or a string from the command line."""
        if dotted_key.count(".") != 1:
            raise RptError(f"{origin}: '{dotted_key}' is not of the form section.key",
                           f"for example: --set train.max_steps=100 (sections: {', '.join(_sections())})")
        section_name, key = dotted_key.split(".")
        _set_field(self._section(section_name, origin), section_name, key, value, origin)
        self._origin(dotted_key, origin)

    def _section(self, name: str, origin: str):
        if name not in _sections():
            raise RptError(f"{origin}: unknown section '{name}'", _suggest(name, _sections(), "section"))
        return getattr(self, name)

    # ----------------------------------------------------------------- output
    def to_dict(self) -> dict:
        tree = dataclasses.asdict(self)
        if self.data.mix:  # a mixture's folders are the data: a path beside them would read as given
            del tree["data"]["path"]
        return tree

    def to_toml(self, origins: bool = False) -> str:
        """TOML that Config.load reads back; with `origins`, each value's line says where it came from (the
        default, a file, --set, the recipe, the data, a measurement) in a comment."""
        text = tomli_w.dumps(self.to_dict())
        if not origins:
            return text
        lines, section = [], ""
        for line in text.splitlines():
            if line.startswith("["):
                section = line.strip("[]")
            elif " = " in line and section in _sections():
                key = f"{section}.{line.split(' = ', 1)[0]}"
                line = f"{line}{ORIGIN}{self.origins.get(key, 'default')}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    # ----------------------------------------------------------------- checks
    def validate(self) -> None:
        """Refuse values that cannot work, naming the fix: each section checks its own. (What spans sections is
        checked by rpt/train/resolve.py's `check`, which every command runs after loading, and the names of cells
        and gates and a cell's options by rpt.models.registry.check_names.)"""
        for name in _sections():
            getattr(self, name).check()

    def get(self, dotted_key: str) -> Any:
        section_name, key = dotted_key.split(".")
        return getattr(getattr(self, section_name), key)


# --------------------------------------------------------------------------- helpers

def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise RptError(f"config file {path} does not exist", "pass an existing file, e.g. --config configs/tiny-cpu.toml")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RptError(f"{path} is not valid TOML: {exc}",
                       "strings need quotes (cell = \"lstm\"), lists brackets ([0.9, 0.95]), sections [name]") from None


ORIGIN = "  # "  # what parts a value from its origin in a run's config.toml (Config.to_toml(origins=True))


def read_origins(path: str | Path) -> dict[str, str]:
    """{section.key: origin} from the comments of a run's config.toml (none for the defaults): the line's last
    ORIGIN mark whose left side is a whole TOML value, so that a string holding the mark stays whole."""
    origins, section = {}, ""
    for line in Path(path).read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if " = " not in line or section not in _sections():
            continue
        key, rest = line.split(" = ", 1)
        parts = rest.split(ORIGIN)
        for cut in range(len(parts) - 1, 0, -1):
            try:
                tomllib.loads("v = " + ORIGIN.join(parts[:cut]))
            except tomllib.TOMLDecodeError:
                continue
            origin = ORIGIN.join(parts[cut:])
            if origin != "default":
                origins[f"{section}.{key}"] = origin
            break
    return origins


def parse_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise RptError(f"--set '{item}' has no '='", "write it as --set section.key=value")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def _suggest(name: str, valid: list[str], what: str) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'? valid {what}s: {', '.join(valid)}"
    return f"valid {what}s: {', '.join(valid)}"


def _set_field(section, section_name: str, key: str, value: Any, origin: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        valid = list(fields)
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        fix = f"did you mean '{section_name}.{close[0]}'?" if close else ""
        raise RptError(f"{origin}: unknown key '{section_name}.{key}'",
                       (fix + " " if fix else "") + f"keys of [{section_name}]: {', '.join(valid)}")
    hint = typing.get_type_hints(type(section))[key]
    setattr(section, key, coerce(value, hint, f"{section_name}.{key}", origin))


def _from_text(text: str) -> Any:
    """A command-line value read as TOML (numbers, booleans, lists); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def coerce(value: Any, hint: Any, key: str, origin: str) -> Any:
    """Check `value` against the field type `hint`; text from the command line is read as TOML first."""
    if isinstance(value, str) and hint is not str:
        parsed = _from_text(value)
        if parsed is not value:
            try:
                return _coerce_typed(parsed, hint, key, origin)
            except RptError:
                if not _accepts_str(hint):
                    raise
    return _coerce_typed(value, hint, key, origin)


def _accepts_str(hint: Any) -> bool:
    if hint is str:
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(isinstance(a, str) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return any(_accepts_str(a) for a in typing.get_args(hint))
    return False


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is list:
        (inner,) = typing.get_args(hint)
        return f"a list of {_type_name(inner)}"
    if origin is dict:
        key, inner = typing.get_args(hint)
        return f"a table of {_type_name(key)} = {_type_name(inner)}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _coerce_typed(value: Any, hint: Any, key: str, origin: str) -> Any:
    def wrong() -> RptError:
        return RptError(f"{origin}: {key} = {value!r} is not {_type_name(hint)}",
                        f"e.g. --set {key}={_example(hint)}")

    kind = typing.get_origin(hint)
    if kind is Literal:
        choices = typing.get_args(hint)
        if value in choices and not isinstance(value, bool):
            return value
        raise wrong()
    if kind in (Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce_typed(value, option, key, origin)
            except RptError:
                continue
        raise wrong()
    if kind is list:
        (inner,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [_from_text(v.strip()) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise wrong()
        try:
            return [_coerce_typed(v, inner, key, origin) for v in value]
        except RptError:
            raise wrong() from None
    if kind is dict:
        key_hint, inner = typing.get_args(hint)
        if not isinstance(value, dict):
            raise wrong()
        try:
            return {_coerce_typed(k, key_hint, key, origin): _coerce_typed(v, inner, key, origin) for k, v in value.items()}
        except RptError:
            raise wrong() from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise wrong()
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise wrong()
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise wrong()
    if hint is str:
        if isinstance(value, str):
            return value
        raise wrong()
    raise TypeError(f"config field {key} has an unsupported type {hint}")  # a bug in rpt, not user input


def _example(hint: Any) -> str:
    kind = typing.get_origin(hint)
    if kind is Literal:
        return str(typing.get_args(hint)[0])
    if kind in (Union, types.UnionType):
        return _example(typing.get_args(hint)[0])
    if kind is list:
        return f"[{_example(typing.get_args(hint)[0])}]"
    if kind is dict:
        return '{"data/web" = 0.7, "data/code" = 0.3}'
    return {int: "16", float: "0.5", bool: "true", str: "name"}.get(hint, "value")


def _positive(name: str, value) -> None:
    if value <= 0:
        raise RptError(f"{name} = {value} must be positive", f"set {name} to 1 or more")


def _non_negative(name: str, value) -> None:
    if value < 0:
        raise RptError(f"{name} = {value} must not be negative", f"set {name} to 0 or more (0 disables it where that makes sense)")
