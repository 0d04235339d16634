"""`RecurrentLM`: embedding -> blocks -> norm -> head, carrying a recurrent state between calls.

    logits, state = model(tokens, state, reset_mask)   # training: the whole chunk, fast paths
    logits, state = model.step(token, state)           # generation: one token, constant memory

The state is a list with one entry per block (the cell's state, and the attention cache where
a block has one). Training carries it from batch to batch, detached (truncated BPTT).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.block import Block, make_norm
from rpt.models.cells.packed_linear import drop_row_packs, generation_products, rows_linear
from rpt.models.sampling import sample_next


class RecurrentLM(nn.Module):
    """`build(name)` says which parts ("embed", "blocks.<i>", "norm", "head") to allocate; the others are made
    on the meta device (shapes only). Each part draws its initial values from its own seed, derived from one
    draw of torch's global generator, so a part has the same values however many of the others are built:
    a pipeline rank allocates its stage alone, with the values the whole model would have given it."""

    def __init__(self, cfg: ModelConfig, build: Callable[[str], bool] | None = None):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise RptError("model.vocab_size is not set", "take it from the data (meta.json) or set model.vocab_size")
        self.cfg = cfg
        base = int(torch.randint(0, 2**62, (1,), device="cpu"))
        parts = iter(range(cfg.n_layers + 3))

        def part(name: str, make: Callable[[], nn.Module]) -> nn.Module:
            seed = base + next(parts)
            if build is not None and not build(name):
                with torch.device("meta"):
                    return make()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return make()

        self.embed = part("embed", lambda: _embedding(cfg))
        self.blocks = nn.ModuleList(part(f"blocks.{i}", lambda i=i: Block(cfg, i)) for i in range(cfg.n_layers))
        self.norm = part("norm", lambda: make_norm(cfg))
        self.head = part("head", lambda: _head(cfg))
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        return [b.init_state(batch, device, dtype) for b in self.blocks]

    def forward(self, tokens: torch.Tensor, state: list | None = None, reset_mask: torch.Tensor | None = None):
        """tokens: [B, T] int64; reset_mask: [B, T] bool (reset the state before reading that token)."""
        x = self.embed(tokens)
        state = state if state is not None else self.init_state(tokens.shape[0], tokens.device)
        x, new_state = run_blocks(self.blocks, x, state, reset_mask)
        return self.head(self.norm(x)), new_state

    def step(self, token: torch.Tensor, state: list | None = None):
        """token: [B] int64. The single-step forms of every cell: what generation runs."""
        x = self.embed(token)
        state = state if state is not None else self.init_state(token.shape[0], token.device)
        new_state = []
        for block, s in zip(self.blocks, state):
            x, s = block(x, s, step=True)
            new_state.append(s)
        return rows_linear(self.norm(x), self.head.weight, self.head.bias), new_state

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> Iterator[int]:
        """Yield new token ids one at a time. prompt: [T] int64. Memory does not grow with the length."""
        was_training = self.training
        self.eval()
        try:
            # the one-row products of each step on the CPU: packed_linear.rows_linear (entered here once, so that a
            # first use builds the native code before any token is out)
            products = generation_products if prompt.device.type == "cpu" else contextlib.nullcontext
            with products():
                logits, state = self(prompt[None])
            logits = logits[:, -1]
            for _ in range(max_new_tokens):
                token = sample_next(logits, temperature, top_k, top_p, generator)
                yield int(token[0])
                with products():
                    logits, state = self.step(token, state)
        finally:
            self.train(was_training)
            drop_row_packs()

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.embed.weight.numel()

    def flops_per_token(self, training: bool = True) -> int:
        """Matrix-product FLOPs per token: every block's cell (recurrent products included), attention,
        MLP and the output head; x3 for forward + backward when training. The embedding lookup is free."""
        forward = sum(b.flops_per_token() for b in self.blocks) + 2 * self.cfg.d_model * self.cfg.vocab_size
        return 3 * forward if training else forward


def run_blocks(blocks, x: torch.Tensor, state: list, reset: torch.Tensor | None):
    """x through `blocks` in order, each with its entry of `state`; returns x and the new state."""
    new = []
    for block, s in zip(blocks, state):
        x, s = block(x, s, reset)
        new.append(s)
    return x, new


def compile_blocks(model: nn.Module, backend: str) -> None:
    """torch.compile each block of `model` (a whole model or a pipeline stage) in place. Per block, as torchtitan
    does: blocks of one shape share their compiled code, and the embedding, head and loss stay eager. In place, so
    parameter names and checkpoints are the eager model's. Graph breaks are allowed: rpt's kernels trace whole,
    but lstm (and gru on a GPU) runs torch's own kernel eagerly inside the block (cells/base.py, over_segments)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(backend=backend)


def _embedding(cfg: ModelConfig) -> nn.Embedding:
    embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(embed.weight, std=0.02)
    return embed


def _head(cfg: ModelConfig) -> nn.Linear:
    if cfg.tie_embeddings:  # its weight will be the embedding's: nothing to allocate
        with torch.device("meta"):
            return nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    return head
