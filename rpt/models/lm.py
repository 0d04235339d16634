"""The language model, top to bottom: `RecurrentLM` (embedding -> blocks -> norm -> head) and its `Block` (the
operations on its recurrent state: rpt/models/state.py; the heads: rpt/models/heads.py; decoding a trained model,
greedy or sampled: rpt/models/decoder.py).

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
from typing import Collection

import numpy as np
import torch
from torch import nn

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.attention import SlidingWindowAttention
from rpt.models.cells.base import Cell
from rpt.models.heads import ClusteredHead, Head
from rpt.models.loop import DepthLoop, mean_depths
from rpt.models.registry import get_cell, import_user_modules
from rpt.models.state import map_state, owned, reset_rows
from rpt.ops.stack.spec import gated_mlp

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
             shared: bool = False, reset: torch.Tensor | None = None):
        """token: [B] int64. The single-step forms of every cell: what generation runs (rpt/models/decoder.py picks
        the tokens). A looped model's `exit` (rpt/models/loop_exit.py; anything with its `stop(model, state)`) ends
        each row's iterations early, `depth` the most; `shared`: its iterations keep one state between tokens (each
        continues from the previous token's last), not one each. `reset`: [B] bool, the rows whose state starts
        afresh before this token (a new document in that row only)."""
        x, new_state = self.step_hidden(token, state, depth, exit, shared, reset)
        return (x if self.head is None else self.head(x)), new_state

    def step_hidden(self, token: torch.Tensor, state: list | None = None, depth: int | None = None, exit=None,
                    shared: bool = False, reset: torch.Tensor | None = None):
        """`step` up to the head: (the final hidden states [B, D], the new state), for a decoder that reads the
        head its own way (rpt/models/decoder.py)."""
        x = self.embed(token) if self.embed is not None else token
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        if reset is not None:
            state = reset_rows(state, reset, self.init_state(x.shape[0], x.device))
        x, new_state = self.run_blocks(x, state, None, depth, True, exit.stop(self, state) if exit else None, shared)
        if self.norm is not None:
            x = self.norm(x)
        return x, new_state

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
