"""The language model, top to bottom: `RecurrentLM` (embedding -> blocks -> norm -> head), its `Block`, its
heads (the operations on its recurrent state: rpt/models/state.py).

    nats, state = model(tokens, state, reset_mask, targets)  # training, evaluation: each target's loss
    logits, state = model(tokens, state, reset_mask)    # the whole chunk's logits (a pipeline stage's loss)
    logits, state = model.step(token, state)            # generation: one token, constant memory

The state is a list with one entry per block (the cell's state, and the attention cache where a block has
one). Training carries it from batch to batch, detached (truncated BPTT).

This is the only forward in rpt. A pipeline stage is this class built with the parts it owns (`parts`): blocks
keep their global index as their name (`blocks.7`), and a missing embedding or head passes its input through.
The cells are in rpt/models/cells, one file per recurrence.
"""

from __future__ import annotations

import contextlib
import math
from typing import Collection, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.attention import SlidingWindowAttention
from rpt.models.cells.base import Cell
from rpt.models.loop import DepthLoop, mean_depths
from rpt.models.registry import get_cell, import_user_modules
from rpt.models.sampling import sample_next
from rpt.models.shapes import on_meta
from rpt.models.state import map_state, owned, reset_rows
from rpt.ops.stack.spec import at_least_fp32, clustered_log_probs, gated_mlp

def part_names(cfg: ModelConfig) -> list[str]:
    """Every part of the whole model, in the order their seeds are numbered."""
    return ["embed", *(f"blocks.{i}" for i in range(cfg.n_layers)), "norm", "head", *(["loop"] if cfg.loop_core else [])]


@contextlib.contextmanager
def own_seed(base: int, part: int):
    """Build one part from its own seed (`base + part`), leaving torch's global generator as it was: a part then
    has the values the whole model gives it, whichever of the others are built beside it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base + part)
        yield


class RecurrentLM(nn.Module):
    def __init__(self, cfg: ModelConfig, parts: Collection[str] | None = None):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise RptError("model.vocab_size is not set", "take it from the data (meta.json) or set model.vocab_size")
        self.cfg = cfg
        keep = set(part_names(cfg) if parts is None else parts)
        base = int(torch.randint(0, 2**62, (1,), device="cpu"))  # one draw of the global generator seeds every part
        embed = None
        if "embed" in keep or ("head" in keep and cfg.tie_embeddings):
            with own_seed(base, 0):
                embed = _embedding(cfg)
        self.embed = embed if "embed" in keep else None
        self.blocks = nn.ModuleDict()
        for i in range(cfg.n_layers):
            if f"blocks.{i}" in keep:
                with own_seed(base, 1 + i):
                    self.blocks[str(i)] = Block(cfg, i)
        self.embed_dropout = nn.Dropout(cfg.embed_dropout)  # no parameters: every stage may hold it
        self.norm = self.head = None
        if "norm" in keep:
            with own_seed(base, cfg.n_layers + 1):
                self.norm = make_norm(cfg)
        if "head" in keep:
            with own_seed(base, cfg.n_layers + 2):  # tied: the embedding's matrix (on a stage without it, its copy)
                self.head = _head(cfg, embed.weight if cfg.tie_embeddings else None)
        self.loop = None  # depth recurrence (model.loop_core; rpt/models/loop.py)
        if "loop" in keep:
            with own_seed(base, cfg.n_layers + 3):
                self.loop = DepthLoop(cfg, make_norm)

    def view(self, parts: Collection[str]) -> "RecurrentLM":
        """A RecurrentLM of some of this one's parts, sharing their modules (a virtual pipeline stage)."""
        view = RecurrentLM.__new__(RecurrentLM)
        nn.Module.__init__(view)
        view.cfg, view.embed_dropout = self.cfg, self.embed_dropout
        view.embed = self.embed if "embed" in parts else None
        view.blocks = nn.ModuleDict({k: b for k, b in self.blocks.items() if f"blocks.{k}" in parts})
        view.norm = self.norm if "norm" in parts else None
        view.head = self.head if "head" in parts else None
        view.loop = self.loop if "loop" in parts else None
        return view

    def order_head(self, counts: np.ndarray) -> None:
        """The two-level head's shortlist: the most frequent tokens by `counts` (nothing to do without that head,
        or on a part of the model without the head)."""
        if isinstance(self.head, ClusteredHead):
            self.head.assign(counts)

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        if self.loop is not None:
            return self.loop.init_state(list(self.blocks.values()), batch, device, dtype, self._prelude_held())
        return [b.init_state(batch, device, dtype) for b in self.blocks.values()]

    def state_layers(self) -> list[int]:
        """The block index of each entry of this model's state (a looped model's core blocks once per slot)."""
        ids = [int(k) for k in self.blocks]
        if self.loop is None:
            return ids
        P, C = self._prelude_held(), self.loop.core
        return ids[:P] + ids[P:P + C] * self.loop.slots + ids[P + C:]

    def _prelude_held(self) -> int:
        """The loop's prelude blocks this model holds (a pipeline stage with the loop may hold some of them)."""
        return sum(int(k) < self.cfg.loop_prelude for k in self.blocks)

    def forward(self, x: torch.Tensor, state: list | None = None, reset_mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, depth: int | None = None, shared: bool = False):
        """x: [B, T] int64 tokens (activations [B, T, D] where the embedding is not built);
        reset_mask: [B, T] bool (reset the state before reading that token); targets: [B, T] next tokens, to
        return each one's loss in nats (float32) in place of the logits (the head's cheaper form); depth: the
        loop's iterations (a looped model's; model.loop_mean by default); shared: as `step` takes it."""
        if self.embed is not None:
            x = self.embed_dropout(self.embed(x))
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        x, new_state = self.run_blocks(x, state, reset_mask, depth, shared=shared)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is None:
            return x, new_state
        x = self.embed_dropout(x)
        return owned(self.head(x) if targets is None else self.head.nats(x, targets)), new_state

    def step(self, token: torch.Tensor, state: list | None = None, depth: int | None = None, exit=None,
             shared: bool = False, sample_k: int | torch.Tensor | None = None, reset: torch.Tensor | None = None):
        """token: [B] int64. The single-step forms of every cell: what generation runs. A looped model's `exit`
        (rpt/models/loop_exit.py; anything with its `stop(model, state)`) ends each row's iterations early,
        `depth` the most; `shared`: its iterations keep one state between tokens (each continues from the previous
        token's last), not one each. `sample_k`: the logits are for sampling among each row's k best tokens
        (`sampling_logits`). `reset`: [B] bool, the rows whose state starts afresh before this token (a new
        document in that row only)."""
        x, new_state = self.step_hidden(token, state, depth, exit, shared, reset)
        if self.head is None:
            return x, new_state
        return (self.head(x) if sample_k is None else self.sampling_logits(x, sample_k)), new_state

    def step_hidden(self, token: torch.Tensor, state: list | None = None, depth: int | None = None, exit=None,
                    shared: bool = False, reset: torch.Tensor | None = None):
        """`step` up to the head: (the final hidden states [B, D], the new state), for a caller that picks its
        tokens itself (`greedy`, `sampling_logits`)."""
        x = self.embed(token) if self.embed is not None else token
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        if reset is not None:
            state = reset_rows(state, reset, self.init_state(x.shape[0], x.device))
        x, new_state = self.run_blocks(x, state, None, depth, True, exit.stop(self, state) if exit else None, shared)
        if self.norm is not None:
            x = self.norm(x)
        return x, new_state

    def sampling_logits(self, h: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
        """The head's logits of hidden states `h` for sampling among each row's k best tokens (1: greedy, 0: all;
        one k or one per row): a two-level head leaves out the rarer tokens of the rows where they cannot be drawn
        (ClusteredHead.for_sampling)."""
        return self.head.for_sampling(h, k) if isinstance(self.head, ClusteredHead) else self.head(h)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's most probable next token from hidden states `h` [B, D] (a two-level head without the
        [B, vocabulary] logits: ClusteredHead.greedy)."""
        return self.head.greedy(h) if isinstance(self.head, ClusteredHead) else self.head(h).argmax(dim=-1)

    def prefill(self, x: torch.Tensor, state: list | None = None, reset_mask: torch.Tensor | None = None,
                depth: int | None = None, shared: bool = False):
        """A prompt (or a chunk of one) through the sequence form: (the logits of its last position [B, V], the
        state after it). Only the last position meets the head: a long prompt's other logits are never made."""
        h, new_state = self.prefill_hidden(x, state, reset_mask, depth, shared)
        return self.head(h), new_state

    def prefill_hidden(self, x: torch.Tensor, state: list | None = None, reset_mask: torch.Tensor | None = None,
                       depth: int | None = None, shared: bool = False):
        """`prefill` up to the head: (the last position's final hidden states [B, D], the state after it), for a
        caller that needs the head on some rows only (a server's prompts that end in this chunk)."""
        if self.embed is not None:
            x = self.embed_dropout(self.embed(x))
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        x, new_state = self.run_blocks(x, state, reset_mask, depth, shared=shared)
        x = x[:, -1]
        return (self.norm(x) if self.norm is not None else x), new_state

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 reset_at: int | None = None, depth: int | None = None, exit=None,
                 shared: bool = False) -> Iterator[int]:
        """Yield new token ids one at a time. prompt: [T] int64. Memory does not grow with the length.
        `reset_at`: a token (the end of text) before which the state starts afresh, in the prompt and after it,
        as training resets it between documents. `depth`, `exit`, `shared`: a looped model's iterations per token,
        as `step` takes them (the prompt runs at `depth`)."""
        was_training = self.training
        self.eval()
        try:
            x = prompt[None]
            logits, state = self.prefill(x, reset_mask=None if reset_at is None else x == reset_at, depth=depth,
                                         shared=shared)
            for _ in range(max_new_tokens):
                token = sample_next(logits, temperature, top_k, top_p, generator)
                yield int(token[0])
                if int(token[0]) == reset_at:
                    state = None  # a new document
                logits, state = self.step(token, state, depth, exit, shared, 1 if temperature <= 0 else top_k)
        finally:
            self.train(was_training)

    def run_blocks(self, x, state: list, reset, depth: int | None, step: bool = False, stop=None,
                   shared: bool = False):
        """Every block in order, each with its state (with a loop, the core's blocks once per iteration)."""
        if self.loop is not None:
            return self.loop(list(self.blocks.values()), x, state, reset, depth, step, stop, shared,
                             self._prelude_held())
        new_state = []
        for block, s in zip(self.blocks.values(), state):
            x, s = block(x, s, reset, step)
            new_state.append(s)
        return x, new_state

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings or self.embed is None else n - self.embed.weight.numel()

    def flops_per_token(self, training: bool = True) -> int:
        """Matrix-product FLOPs per token: every block's cell (recurrent products included), attention,
        MLP and the output head; x3 for forward + backward when training. The embedding lookup is free."""
        blocks = {int(k): b.flops_per_token() for k, b in self.blocks.items()}
        forward = sum(blocks.values()) + (self.head.flops_per_token() if self.head is not None else 0)
        if self.loop is None:
            return 3 * forward if training else forward
        # the core (and the adapter) run r times forward, and backward only in the last k iterations
        core = sum(f for k, f in blocks.items() if self.loop.prelude <= k < self.loop.prelude + self.loop.core)
        core += self.loop.flops_per_token(self.cfg.d_model)
        runs, kept = mean_depths(self.cfg) if training else (self.loop.default_depth, 0)
        once = forward - core + self.loop.flops_per_token(self.cfg.d_model)
        return int(3 * once + core * (runs + 2 * kept)) if training else once + core * runs


def _embedding(cfg: ModelConfig) -> nn.Embedding:
    embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(embed.weight, std=0.02)
    return embed


def _head(cfg: ModelConfig, tied: nn.Parameter | None) -> nn.Module:
    if cfg.head_shortlist:
        return ClusteredHead(cfg.d_model, cfg.vocab_size, cfg.head_shortlist, tied)
    return Head(cfg.d_model, cfg.vocab_size, tied)


# ---------------------------------------------------------------------------------------------- the block
# Gated pre-norm residual sub-layers around a recurrent cell:
#
#     x = x + gamma_cell * dropout(cell(norm(x)))                  always
#     x = x + gamma_attn * attention(norm(x))                      every `attention_every`-th block
#     x = x + gamma_mlp  * dropout(mlp(norm(x)))                   when mlp_ratio > 0 (gated SiLU MLP)
#
# The residual gates gamma are learned per channel and start at 1/sqrt(n_layers), so a deep stack starts close
# to the identity and every block's contribution grows as it learns: a 48-block stack trains from the first step
# (a test holds it to that).

def build_cell(cfg: ModelConfig) -> Cell:
    import_user_modules(cfg.imports)
    cls = get_cell(cfg.cell)
    options = {name: getattr(cfg, name) for name in cls.options}  # what the cell declares it takes
    if options.get("forget_bias") == "auto":
        options["forget_bias"] = None  # the cell's (its gate's) own
    cell = cls(cfg.d_model, cfg.d_hidden, **options)
    if cfg.weight_norm:
        apply_weight_norm(cell)
    return cell


def apply_weight_norm(cell: nn.Module) -> None:
    """Weight normalisation (Salimans & Kingma 2016) on every matrix of the cell, kept as a parametrization."""
    for module in list(cell.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 2:
                torch.nn.utils.parametrizations.weight_norm(module, name, dim=0)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


class GatedMLP(nn.Module):
    def __init__(self, d_model: int, ratio: float):
        super().__init__()
        hidden = max(8, int(round(d_model * ratio / 8)) * 8)
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return gated_mlp(x, self.up, self.down)

    def flops_per_token(self) -> int:
        return 2 * 3 * self.up.in_features * self.down.in_features


def has_attention(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` holds the attention sub-layer: every `attention_every`-th block."""
    return bool(cfg.attention_every) and (index + 1) % cfg.attention_every == 0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        D, gain = cfg.d_model, 1 / math.sqrt(cfg.n_layers)
        self.cell_norm, self.cell = make_norm(cfg), build_cell(cfg)
        self.cell_gate = nn.Parameter(torch.full((D,), gain))
        self.attn = None
        if has_attention(cfg, index):
            self.attn_norm = make_norm(cfg)
            self.attn = SlidingWindowAttention(D, cfg.attention_heads, cfg.attention_window)
            self.attn_gate = nn.Parameter(torch.full((D,), gain))
        self.mlp = None
        if cfg.mlp_ratio > 0:
            self.mlp_norm, self.mlp = make_norm(cfg), GatedMLP(D, cfg.mlp_ratio)
            self.mlp_gate = nn.Parameter(torch.full((D,), gain))
        self.dropout = nn.Dropout(cfg.dropout)

    def init_state(self, batch, device=None, dtype=None):
        cell = self.cell.init_state(batch, device, dtype)
        attn = self.attn.init_state(batch, device, dtype) if self.attn is not None else ()
        return (cell, attn)

    def forward(self, x, state, reset=None, step: bool = False):
        cell_state, attn_state = state
        if step:  # one token, x: [B, D]
            y, cell_state = self.cell.step(self.cell_norm(x), cell_state)
        else:
            y, cell_state = self.cell(self.cell_norm(x), cell_state, reset)
        x = x + self.cell_gate * self.dropout(y)
        if self.attn is not None:
            a_in = self.attn_norm(x)
            y, attn_state = self.attn(a_in[:, None] if step else a_in, attn_state, None if step else reset)
            x = x + self.attn_gate * (y[:, 0] if step else y)
        if self.mlp is not None:
            x = x + self.mlp_gate * self.dropout(self.mlp(self.mlp_norm(x)))
        return x, (cell_state, attn_state) if step else map_state(owned, (cell_state, attn_state))

    def flops_per_token(self) -> int:
        total = self.cell.flops_per_token()
        total += self.attn.flops_per_token() if self.attn is not None else 0
        total += self.mlp.flops_per_token() if self.mlp is not None else 0
        return total


# ---------------------------------------------------------------------------------------------- the heads
# Final hidden states -> log-probabilities of the next token, in two forms side by side:
#
#     logits = head(h)             # [..., V]: generation and sampling (for ClusteredHead, log-probabilities)
#     nats = head.nats(h, targets) # [...]: each target's negative log-probability, float32 (training, evaluation)
#
# `Head` is one linear map over the whole vocabulary (tied to the embedding by default).
#
# `ClusteredHead` (`model.head_shortlist = S`) is a two-level softmax: the S most frequent training tokens and one
# entry for "a rarer token" share the first softmax, the rarer ones have their own, so that
# log p(t) = log p_head(t) for a frequent token and log p_head(rest) + log p_tail(t) for a rare one: still an
# exact distribution over the whole vocabulary. `nats` computes the tail only for the rows whose target is in it,
# so on text whose S most frequent tokens cover 80-90% of it the head costs about a third of a full softmax. It is
# the shortlist and tail of Grave et al.'s adaptive softmax with the tail kept at full width, so that both levels
# read the (tied) embedding matrix; torch's AdaptiveLogSoftmaxWithLoss projects its tail clusters to narrower
# widths and cannot share the embedding. Which tokens are frequent is a buffer (`order`), set from the training
# tokens at a fresh start (`assign`) and saved in every checkpoint.

class Head(nn.Linear):
    """The full softmax: logits = h @ W^T over the whole vocabulary."""

    def __init__(self, d_model: int, vocab_size: int, tied: nn.Parameter | None = None):
        if tied is not None:  # the embedding's matrix: nothing to allocate
            with on_meta():
                super().__init__(d_model, vocab_size, bias=False)
            self.weight = tied
        else:
            super().__init__(d_model, vocab_size, bias=False)
            nn.init.normal_(self.weight, std=0.02)

    def nats(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(h), targets, reduction="none")

    def flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features


class ClusteredHead(nn.Module):
    """The two-level softmax: `shortlist` frequent tokens and a "rarer token" entry, then the rarer tokens."""

    def __init__(self, d_model: int, vocab_size: int, shortlist: int, tied: nn.Parameter | None = None):
        super().__init__()
        self.shortlist, self.vocab_size = shortlist, vocab_size
        if tied is not None:
            self.weight = tied
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            nn.init.normal_(self.weight, std=0.02)
        self.rest = nn.Linear(d_model, 1)  # the logit of "a token outside the shortlist"
        nn.init.zeros_(self.rest.weight)
        nn.init.zeros_(self.rest.bias)
        self.register_buffer("order", torch.arange(vocab_size))  # token ids, the most frequent first
        self.tail_share = 1.0 - shortlist / vocab_size  # of training tokens outside the shortlist (for FLOPs)

    @torch.no_grad()
    def assign(self, counts: np.ndarray) -> None:
        """Put the most frequent tokens of `counts` (occurrences per token id) in the shortlist; ties by id."""
        order = np.argsort(-np.asarray(counts, dtype=np.int64), kind="stable")
        self.order.copy_(torch.from_numpy(order))
        self.tail_share = float(np.asarray(counts)[order[self.shortlist:]].sum() / max(1, np.sum(counts)))

    def _rank(self) -> torch.Tensor:
        """Each token id's place in `order`."""
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(len(self.order), device=self.order.device)
        return rank

    def _head_logits(self, h: torch.Tensor, short: torch.Tensor | None = None) -> torch.Tensor:
        """The first level's logits [rows, S + 1]: the shortlist's rows of the matrix (`short`, or taken from it
        here, where gradients reach it) and the rarer-token entry."""
        short = self.weight.index_select(0, self.order[:self.shortlist]) if short is None else short
        return at_least_fp32(torch.cat([self.linear(h, short), self.rest(h)], dim=-1))

    def _tail_logits(self, h: torch.Tensor) -> torch.Tensor:
        return at_least_fp32(F.linear(h, self.weight.index_select(0, self.order[self.shortlist:])))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the whole vocabulary, in token-id order: one product with the matrix as it is
        (not copied into shortlist order, which cost generation four times the product), each level normalised
        over its own tokens."""
        return clustered_log_probs(h, self.weight, self.rest.weight, self.rest.bias, self.order, self.shortlist)

    # The product inference runs: F.linear. A server or `rpt generate` on the CPU swaps in packed products from
    # outside (rpt.kernels.cpu.products.row_products), as for the cells.
    linear = staticmethod(F.linear)

    _held = None  # (the key of the matrix it was taken from, the shortlist's rows)

    def _shortlist_weight(self) -> nn.Parameter:
        """The shortlist's rows of the matrix in `order`, kept for inference until the matrix or the order changes
        (an index_select per token cost a 32-row decode step a tenth of its time); a Parameter so that packed
        products keep their packing of it."""
        key = (self.weight.data_ptr(), self.weight._version, self.order._version)
        if self._held is None or self._held[0] != key:
            short = self.weight.detach().index_select(0, self.order[:self.shortlist])
            self._held = (key, nn.Parameter(short, requires_grad=False))
        return self._held[1]

    @torch.no_grad()
    def for_sampling(self, h: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
        """What `forward` gives, with the rarer tokens at -inf in the rows where sampling (rpt/models/sampling.py)
        cannot pick them: a row sampled among its k best tokens (`k`: one for all rows or one per row; 1: greedy,
        0: no limit) whose k-th best shortlist token is above the rarer-token entry (a rarer token's probability is
        at most that entry's). Every row runs the shortlist's product; only the others run the whole matrix's, for
        their rarer tokens. A row's result does not depend on the others'."""
        S, V = self.shortlist, self.vocab_size
        flat = h.reshape(-1, h.shape[-1])
        k = torch.as_tensor(k, device=h.device).expand(len(flat))
        first = self._first_level(flat)
        usable = (k > 0) & (k <= S)
        short = torch.zeros_like(usable)
        if bool(usable.any()):
            most = int(k[usable].max())
            kth = first[:, :S].topk(most, dim=-1).values.gather(1, (k.clamp(1, most) - 1)[:, None])[:, 0]
            short = usable & (kth > first[:, S])
        out = torch.full((len(flat), V), -math.inf, dtype=first.dtype, device=first.device)
        out.index_copy_(-1, self.order[:S], first[:, :S])
        if not bool(short.all()):
            rest = (~short).nonzero()[:, 0]
            rows = self._rarer_logits(flat[rest]).log_softmax(-1) + first[rest, S:]
            out.index_copy_(0, rest, rows.index_copy_(-1, self.order[:S], first[rest, :S]))
        return out.view(*h.shape[:-1], V)

    @torch.no_grad()
    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The most probable token of each row, as the argmax of `for_sampling(h, 1)` (but a tie between a
        shortlist token and a rarer one goes to the shortlist's): the best shortlist token, or for a row whose
        rarer-token entry outweighs it, the best rarer token where that one's probability is higher. No
        [rows, vocabulary] tensor is made (in a 32-row decode step its filling and argmax took a quarter of
        the step)."""
        S = self.shortlist
        flat = h.reshape(-1, h.shape[-1])
        first = self._first_level(flat)
        best, at = first[:, :S].max(dim=-1)
        ids = self.order[:S][at]
        rest = (best <= first[:, S]).nonzero()[:, 0]
        if len(rest) and self._screens(flat):
            rest = rest[self._rarer_may_win(flat[rest], best[rest] - first[rest, S])]
        if len(rest):
            z = self._rarer_logits(flat[rest])
            most, token = z.max(dim=-1)  # the best rarer token's log-probability among them: -log sum exp(z - most)
            wins = first[rest, S] - z.sub_(most[:, None]).exp_().sum(-1).log_() > best[rest]
            ids[rest[wins]] = token[wins]
        return ids.view(h.shape[:-1])

    # The screen's error bound per unit of |h| |W_t| (rounding h and W to bfloat16, 2 x 2^-8, and their product's
    # float32 sum), and its output's per unit of |z'| (rounding to bfloat16: 2^-8, doubled); SLACK covers the
    # float32 rounding of the exact path's own comparison.
    SCREEN_INPUTS, SCREEN_OUTPUT, SLACK = 2 ** -7 + 2 ** -15, 2 ** -7, 1e-3
    _screen = None  # (the key of the matrix it was taken from, the tail's rows in bfloat16, their largest norm)

    def _screens(self, flat: torch.Tensor) -> bool:
        return (flat.device.type == "cpu" and flat.dtype == self.weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def _screen_weight(self) -> tuple[nn.Parameter, float]:
        key = (self.weight.data_ptr(), self.weight._version, self.order._version)
        if self._screen is None or self._screen[0] != key:
            tail = self.weight.detach().index_select(0, self.order[self.shortlist:])
            self._screen = (key, nn.Parameter(tail.bfloat16(), requires_grad=False), float(tail.norm(dim=1).max()))
        return self._screen[1], self._screen[2]

    def _rarer_may_win(self, flat: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        """Which rows' best rarer token may outweigh their best shortlist token (`margin`: that token's
        log-probability less the rarer-token entry's), from the tail's product in bfloat16 (on AMX a fraction of
        float32's time; benchmarks/results/serve.md): its logits z' are within
        err = SCREEN_INPUTS |h| max|W_t| + SCREEN_OUTPUT max|z'| of the exact z, so the best rarer token's
        log-probability within its level, max z - logsumexp z, is at most max z' - logsumexp z' + 2 err. A row this
        rules out is one the exact path would rule out too (no rarer token wins); the others run it. Few rows
        pass: a rarer token's probability within its level is mostly far below what it would need."""
        tail, most = self._screen_weight()
        z = self.linear(flat.to(tail.dtype), tail).float()
        err = (self.SCREEN_INPUTS + flat.shape[-1] * 2 ** -23) * flat.norm(dim=-1) * most \
            + self.SCREEN_OUTPUT * z.abs().amax(dim=-1)
        top = z.amax(dim=-1, keepdim=True)
        best_within = -z.sub_(top).exp_().sum(-1).log_()  # max z' - logsumexp z'
        return best_within + 2 * err + self.SLACK > margin

    def warm(self, rows: int) -> None:
        """Run each product inference may run on `rows` rows (their packings and oneDNN's memory for the shape are
        made now, a server's fixed memory holds them)."""
        h = self.weight.new_zeros(rows, self.weight.shape[1])
        self.linear(h, self._shortlist_weight())
        self.linear(h, self.weight)
        if self._screens(h):
            tail, _ = self._screen_weight()
            self.linear(h.to(tail.dtype), tail)

    def _first_level(self, flat: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the shortlist's tokens and the rarer-token entry [rows, S + 1], for inference."""
        return self._head_logits(flat, self._shortlist_weight()).log_softmax(-1)

    def _rarer_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """The rarer tokens' logits [rows, V] in token-id order, the shortlist's at -inf, for inference: one product
        with the whole matrix as it is (its packing is kept; a copy of the tail's rows would be another 30 MB at
        this size)."""
        return at_least_fp32(self.linear(flat, self.weight)).index_fill_(-1, self.order[:self.shortlist], -math.inf)

    def nats(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S, shape = self.shortlist, targets.shape
        h, rank = h.flatten(0, -2), self._rank()[targets.flatten()]
        in_tail = rank >= S
        nats = F.cross_entropy(self._head_logits(h), torch.where(in_tail, S, rank), reduction="none")
        rows = in_tail.nonzero().squeeze(1)
        if rows.numel():
            tail = F.cross_entropy(self._tail_logits(h[rows]), rank[rows] - S, reduction="none")
            nats = nats.index_add(0, rows, tail)
        return nats.view(shape)

    def flops_per_token(self) -> int:
        d = self.weight.shape[1]
        return int(2 * d * (self.shortlist + 1) + 2 * d * (self.vocab_size - self.shortlist) * self.tail_share)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of each position's next token from full logits, in float32 whatever the autocast dtype (with
    reduction "none", in the targets' shape): the full head's nats and the pipeline's last stage."""
    loss = F.cross_entropy(at_least_fp32(logits).flatten(0, -2), targets.flatten(), reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss
