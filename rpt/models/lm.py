"""`RecurrentLM`: embedding -> blocks -> norm -> head, carrying a recurrent state between calls.

    nats, state = model(tokens, state, reset_mask, targets)  # training, evaluation: each target's loss
    logits, state = model(tokens, state, reset_mask)    # the whole chunk's logits (a pipeline stage's loss)
    logits, state = model.step(token, state)            # generation: one token, constant memory

The state is a list with one entry per block (the cell's state, and the attention cache where a block has
one). Training carries it from batch to batch, detached (truncated BPTT).

This is the only forward in rpt. A pipeline stage is this class built with the parts it owns (`parts`): blocks
keep their global index as their name (`blocks.7`), and a missing embedding or head passes its input through.
"""

from __future__ import annotations

import contextlib
from typing import Collection, Iterator

import torch
from torch import nn

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.block import Block, make_norm
from rpt.models.head import ClusteredHead, Head
from rpt.models.sampling import sample_next


def part_names(cfg: ModelConfig) -> list[str]:
    """Every part of the whole model, in the order their seeds are numbered."""
    return ["embed", *(f"blocks.{i}" for i in range(cfg.n_layers)), "norm", "head"]


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

    def view(self, parts: Collection[str]) -> "RecurrentLM":
        """A RecurrentLM of some of this one's parts, sharing their modules (a virtual pipeline stage)."""
        view = RecurrentLM.__new__(RecurrentLM)
        nn.Module.__init__(view)
        view.cfg, view.embed_dropout = self.cfg, self.embed_dropout
        view.embed = self.embed if "embed" in parts else None
        view.blocks = nn.ModuleDict({k: b for k, b in self.blocks.items() if f"blocks.{k}" in parts})
        view.norm = self.norm if "norm" in parts else None
        view.head = self.head if "head" in parts else None
        return view

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        return [b.init_state(batch, device, dtype) for b in self.blocks.values()]

    def forward(self, x: torch.Tensor, state: list | None = None, reset_mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None):
        """x: [B, T] int64 tokens (activations [B, T, D] where the embedding is not built);
        reset_mask: [B, T] bool (reset the state before reading that token); targets: [B, T] next tokens, to
        return each one's loss in nats (float32) in place of the logits (the head's cheaper form)."""
        if self.embed is not None:
            x = self.embed_dropout(self.embed(x))
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        new_state = []
        for block, s in zip(self.blocks.values(), state):
            x, s = block(x, s, reset_mask)
            new_state.append(s)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is None:
            return x, new_state
        x = self.embed_dropout(x)
        return (self.head(x) if targets is None else self.head.nats(x, targets)), new_state

    def step(self, token: torch.Tensor, state: list | None = None):
        """token: [B] int64. The single-step forms of every cell: what generation runs."""
        x = self.embed(token) if self.embed is not None else token
        state = state if state is not None else self.init_state(x.shape[0], x.device)
        new_state = []
        for block, s in zip(self.blocks.values(), state):
            x, s = block(x, s, step=True)
            new_state.append(s)
        if self.norm is not None:
            x = self.norm(x)
        return (self.head(x) if self.head is not None else x), new_state

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 reset_at: int | None = None) -> Iterator[int]:
        """Yield new token ids one at a time. prompt: [T] int64. Memory does not grow with the length.
        `reset_at`: a token (the end of text) before which the state starts afresh, in the prompt and after it,
        as training resets it between documents."""
        was_training = self.training
        self.eval()
        try:
            x = prompt[None]
            logits, state = self(x, reset_mask=None if reset_at is None else x == reset_at)
            logits = logits[:, -1]
            for _ in range(max_new_tokens):
                token = sample_next(logits, temperature, top_k, top_p, generator)
                yield int(token[0])
                if int(token[0]) == reset_at:
                    state = None  # a new document
                logits, state = self.step(token, state)
        finally:
            self.train(was_training)

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings or self.embed is None else n - self.embed.weight.numel()

    def flops_per_token(self, training: bool = True) -> int:
        """Matrix-product FLOPs per token: every block's cell (recurrent products included), attention,
        MLP and the output head; x3 for forward + backward when training. The embedding lookup is free."""
        forward = sum(b.flops_per_token() for b in self.blocks.values())
        forward += self.head.flops_per_token() if self.head is not None else 0
        return 3 * forward if training else forward


def _embedding(cfg: ModelConfig) -> nn.Embedding:
    embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(embed.weight, std=0.02)
    return embed


def _head(cfg: ModelConfig, tied: nn.Parameter | None) -> nn.Module:
    if cfg.head_shortlist:
        return ClusteredHead(cfg.d_model, cfg.vocab_size, cfg.head_shortlist, tied)
    return Head(cfg.d_model, cfg.vocab_size, tied)
