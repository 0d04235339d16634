"""An rpt recurrent language model for Hugging Face transformers, written with torch and transformers only.

`rpt export` writes this file beside the weights, so that

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

builds the model without rpt installed. The cell runs its reference form: the step of the recurrence in
plain torch ops (F.linear and pointwise), in a Python loop over time. The step and the layer around it
(`Layer`) are rpt's own spec, the file rpt/ops/FAMILY/spec.py that rpt's cell runs, shipped beside this one as
spec_cell.py and imported relatively (transformers copies such files with the module); this file names no
family. So is the rest of the maths (spec_stack.py: attention, the gated MLP, the two-level head, the loop's
injection; spec_loop.py: the loop): this file only assembles the parts, so the exported model cannot drift from
rpt's. That is exact and runs on any device, but it is much slower than rpt's fused kernels: train and evaluate at
scale with rpt, use this for interchange.

Parameter names are rpt's own (`blocks.3.cell.w_hh`), so the weights load both ways unchanged. The recurrent
state is the generation cache (`RptState`): one token at a time, memory constant in the length.

Every row read from a fresh state is a document, as rpt trains on them: it starts from the state the end-of-text
token leaves, whether the row begins with that token or not (so `tok(text)` needs no special token, and lm-eval's
requests score as rpt's evaluation does), and after left padding it starts at its first real token. The state
resets at each end-of-text token inside a row when `config.reset_at_eot`, as in rpt's training. Beam search
(which reorders the cache) is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_rpt import RptConfig
from .spec_cell import Layer
from .spec_loop import run_loop
from .spec_stack import clustered_log_probs, gated_mlp, inject, sliding_window_attention


# ---------------------------------------------------------------------------------------------- the stack
class SlidingWindowAttention(nn.Module):
    """Causal attention over the last `window` positions of the same document; its state is the last W keys and
    values, so that generation keeps constant memory."""

    def __init__(self, cfg: RptConfig):
        super().__init__()
        D = cfg.d_model
        self.d_model, self.n_heads, self.window = D, cfg.attention_heads, cfg.attention_window
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        zeros = like.new_zeros(batch, self.window, self.d_model)
        return zeros, zeros.clone(), like.new_zeros(batch, self.window)

    def forward(self, x, state, reset):
        return sliding_window_attention(x, state, reset, self.qkv, self.out, self.n_heads, self.window)


class GatedMLP(nn.Module):
    def __init__(self, d_model: int, ratio: float):
        super().__init__()
        hidden = max(8, int(round(d_model * ratio / 8)) * 8)
        self.up, self.down = nn.Linear(d_model, 2 * hidden, bias=False), nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return gated_mlp(x, self.up, self.down)


def make_norm(cfg: RptConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


class Block(nn.Module):
    """x += gate_cell * cell(norm(x)); x += gate_attn * attention(norm(x)) (some blocks); x += gate_mlp * mlp(norm(x))."""

    def __init__(self, cfg: RptConfig, index: int):
        super().__init__()
        D = cfg.d_model
        self.cell_norm, self.cell = make_norm(cfg), Layer(cfg)
        self.cell_gate = nn.Parameter(torch.ones(D))
        self.attn = None
        if cfg.attention_every and (index + 1) % cfg.attention_every == 0:
            self.attn_norm, self.attn = make_norm(cfg), SlidingWindowAttention(cfg)
            self.attn_gate = nn.Parameter(torch.ones(D))
        self.mlp = None
        if cfg.mlp_ratio > 0:
            self.mlp_norm, self.mlp = make_norm(cfg), GatedMLP(D, cfg.mlp_ratio)
            self.mlp_gate = nn.Parameter(torch.ones(D))

    def init_state(self, batch: int, like: torch.Tensor):
        return self.cell.init_state(batch, like), self.attn.init_state(batch, like) if self.attn is not None else ()

    def forward(self, x, state, reset):
        """x: [B, T, D]; reset: [B, T] bool, start the state fresh before that position."""
        cell_state, attn_state = state
        inp, ys = self.cell_norm(x), []
        for t in range(x.shape[1]):  # the reference form: one step at a time
            keep = (~reset[:, t]).to(x.dtype)
            y, cell_state = self.cell.step(inp[:, t], tuple(s * keep.view(-1, *[1] * (s.dim() - 1)) for s in cell_state))
            ys.append(y)
        x = x + self.cell_gate * torch.stack(ys, dim=1)
        if self.attn is not None:
            y, attn_state = self.attn(self.attn_norm(x), attn_state, reset)
            x = x + self.attn_gate * y
        if self.mlp is not None:
            x = x + self.mlp_gate * self.mlp(self.mlp_norm(x))
        return x, (cell_state, attn_state)


class Head(nn.Module):
    """The full softmax (`weight` tied to the embedding unless the run untied it)."""

    def __init__(self, cfg: RptConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))

    def forward(self, h):
        return F.linear(h, self.weight)


class ClusteredHead(Head):
    """The two-level softmax: log-probabilities, the `shortlist` most frequent tokens (`order`) and one entry for
    the rest in the first level, the rest in the second."""

    def __init__(self, cfg: RptConfig):
        super().__init__(cfg)
        self.shortlist = cfg.head_shortlist
        self.rest = nn.Linear(cfg.d_model, 1)
        self.register_buffer("order", torch.arange(cfg.vocab_size))

    def forward(self, h):
        return clustered_log_probs(h, self.weight, self.rest.weight, self.rest.bias, self.order, self.shortlist)


class Loop(nn.Module):
    """Depth recurrence (rpt's model.loop_*): the core blocks run num_steps times between the prelude and the coda
    (spec_loop.run_loop), each iteration reading adapter(cat(h, e)) (or h + e), e the prelude's output normalised;
    the state holds each core block once per iteration."""

    def __init__(self, cfg: RptConfig):
        super().__init__()
        D = cfg.d_model
        self.adapter = nn.Linear(2 * D, D, bias=False) if cfg.loop_inject == "linear" else None
        self.norm, self.inject_norm = make_norm(cfg), make_norm(cfg)

    def inject(self, h, e):
        return inject(h, e, self.adapter)


# ---------------------------------------------------------------------------------------------- transformers
class RptState:
    """The generation cache: every block's recurrent state (and its attention window), and the tokens seen."""

    def __init__(self, blocks: list, seen: int = 0):
        self.blocks, self.seen = blocks, seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


@dataclass
class RptCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: RptState | None = None


class RptForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RptConfig
    base_model_prefix = "rpt"
    _is_stateful = True
    _tied_weights_keys = {"head.weight": "embed.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config: RptConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm = make_norm(config)
        self.head = ClusteredHead(config) if config.head_shortlist else Head(config)
        self.loop = Loop(config) if config.loop_core else None
        if self.loop is not None:
            self._depth(None)  # config.loop_depth, as config.json or from_pretrained(..., loop_depth=N) gave it
        self.post_init()

    def _depth(self, num_steps: int | None) -> int:
        """The core's iterations: `num_steps`, else config.loop_depth; refused below 1 (as `rpt eval --depth`)."""
        depth, name = (self.config.loop_depth, "loop_depth") if num_steps is None else (num_steps, "num_steps")
        if depth < 1:
            default = f" (the model's own: loop_depth = {self.config.loop_depth})" if num_steps is not None else ""
            raise ValueError(f"{name} = {depth}: a looped model runs its core at least once; use {name} = 1 or "
                             f"more{default}")
        return depth

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the recurrent state (RptState), made by forward

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.head

    def _init_weights(self, module):  # every weight comes from the checkpoint; fresh ones start small
        if isinstance(module, (nn.Linear, nn.Embedding)) or isinstance(module, Head):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: RptState | None = None, labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, logits_to_keep: int = 0, num_steps: int | None = None,
                **kwargs) -> RptCausalLMOutput:
        """`num_steps`: a looped model's iterations of its core (config.loop_depth by default), as Huginn's takes it
        (also through generate(..., num_steps=N))."""
        B, T = input_ids.shape
        if cache is None:  # fresh rows: each starts as a document (one column more, dropped below)
            ids, reset = self._start_documents(input_ids, attention_mask)
        else:
            ids, reset = input_ids, self._eot_resets(input_ids)
        x = self.embed(ids)
        x, new_state = self._run_blocks(x, cache.blocks if cache is not None else self._fresh_state(B, x), reset,
                                        num_steps)
        x = self.norm(x[:, -T:])
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.head(x).float()
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        seen = (cache.seen if cache is not None else 0) + T
        return RptCausalLMOutput(loss=loss, logits=logits, cache=RptState(new_state, seen) if use_cache else None)

    def _fresh_state(self, batch: int, like: torch.Tensor) -> list:
        fresh = [b.init_state(batch, like) for b in self.blocks.values()]
        if self.loop is None:
            return fresh
        P, C = self.config.loop_prelude, self.config.loop_core
        return fresh[:P] + fresh[P:P + C] * self.config.loop_slots + fresh[P + C:]

    def _run_blocks(self, x, state: list, reset, num_steps: int | None):
        blocks = list(self.blocks.values())
        if self.loop is not None:
            c = self.config
            return run_loop(lambda block, x, s: block(x, s, reset), blocks, x, state, self._depth(num_steps),
                            c.loop_prelude, c.loop_core, self.loop.inject, self.loop.norm, self.loop.inject_norm,
                            torch.zeros_like)
        if num_steps is not None:
            raise ValueError(f"num_steps = {num_steps} for a model without a loop (loop_core = 0): leave it out; only "
                             "a looped model runs at a chosen depth")
        new_state = []
        for block, s in zip(blocks, state):
            x, s = block(x, s, reset)
            new_state.append(s)
        return x, new_state

    def _eot_resets(self, ids):
        eot = self.config.eot_token_id
        return ids == eot if self.config.reset_at_eot else torch.zeros_like(ids, dtype=torch.bool)

    def _start_documents(self, input_ids, attention_mask):
        """The rows with one column in front, and where their state resets. The column before each row's first
        real token (that one, or the last left padding) becomes an end-of-text token read from a fresh state; a
        first real token that is itself the end-of-text token starts afresh again, so it is read once."""
        B, T = input_ids.shape
        eot = self.config.eot_token_id
        real = attention_mask[:, -T:].bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        ids = torch.cat([input_ids.new_full((B, 1), eot), input_ids], 1)
        real = torch.cat([real.new_zeros(B, 1), real], 1)
        first = real.int().argmax(1)  # the first real column (>= 1 in a row that has one)
        cols = torch.arange(T + 1, device=ids.device)[None]
        start = cols == (first - 1).clamp(min=0)[:, None]
        ids = torch.where(start, eot, ids)
        reset = self._eot_resets(ids) | start | ((cols == first[:, None]) & (ids == eot))
        return ids, reset
