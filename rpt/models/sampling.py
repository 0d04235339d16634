"""Choosing the next token from logits: temperature, top-k, nucleus (top-p); greedy at temperature 0. `sample_next`
takes one setting and one generator for the batch (`rpt generate`); `sample_rows` one of each per row (a server's
streams), each row's draw coming from its own uniform number, so that a seeded stream draws the same tokens
whatever rows run beside it."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> token ids [B]."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                uniform: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; temperature, top_p: [B] float; top_k: [B] int (0: no limit); uniform: [B] numbers in [0, 1),
    each row's own draw -> token ids [B]. A row at temperature 0 takes its best token; another samples by the
    inverse of its distribution's cumulative sum (over the tokens sorted best first) at its uniform number."""
    greedy = logits.argmax(dim=-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy
    rows = sampled.nonzero()[:, 0]
    x = logits[rows].float() / temperature[rows, None].float()
    ordered, order = torch.sort(x, descending=True, dim=-1)
    rank = torch.arange(x.shape[-1], device=x.device)
    k = top_k[rows]
    ordered = ordered.masked_fill((k[:, None] > 0) & (rank >= k[:, None]), float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # drop a token when the tokens ranked above it already hold top_p of the mass (the best one always stays)
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p[rows, None].float(), float("-inf"))
    cdf = torch.softmax(ordered, dim=-1).cumsum(-1)
    pick = torch.searchsorted(cdf, (uniform[rows].to(cdf.dtype) * cdf[:, -1])[:, None]).clamp_max(x.shape[-1] - 1)
    return greedy.index_copy(0, rows, order.gather(1, pick)[:, 0])
