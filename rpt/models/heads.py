"""The heads: final hidden states -> log-probabilities of the next token, what training and evaluation read (the
decoding of a trained model, greedy choice, sampling and the two-level head's screen, is rpt/models/decoder.py's).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rpt.models.shapes import on_meta
from rpt.ops.stack.spec import at_least_fp32, clustered_log_probs


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

    def _head_logits(self, h: torch.Tensor, short: torch.Tensor | None = None, linear=F.linear) -> torch.Tensor:
        """The first level's logits [rows, S + 1]: the shortlist's rows of the matrix (`short`, or taken from it
        here, where gradients reach it) and the rarer-token entry; `linear`: the product (a decoder's packed one)."""
        short = self.weight.index_select(0, self.order[:self.shortlist]) if short is None else short
        return at_least_fp32(torch.cat([linear(h, short), self.rest(h)], dim=-1))

    def _tail_logits(self, h: torch.Tensor) -> torch.Tensor:
        return at_least_fp32(F.linear(h, self.weight.index_select(0, self.order[self.shortlist:])))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the whole vocabulary, in token-id order: one product with the matrix as it is
        (not copied into shortlist order, which cost generation four times the product), each level normalised
        over its own tokens."""
        return clustered_log_probs(h, self.weight, self.rest.weight, self.rest.bias, self.order, self.shortlist)

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
