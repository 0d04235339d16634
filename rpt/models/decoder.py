"""Decoding a trained model, apart from it (vLLM keeps sampling in its own module): each row's next token, greedy
or sampled with its own settings, and `generate`, one token at a time at constant memory. Used by `rpt generate`,
`rpt serve`'s engine and the tests alike. For a two-level head (`ClusteredHead`) the decoding reads the shortlist
first and the rarer tokens only where they can matter (`TwoLevelDecoding`): its caches of the matrix's rows and
the bfloat16 screen are the decoder's, and so is the product it runs (`linear`: F.linear, or the CPU's packed
products, rpt.kernels.cpu.products.RowProducts, given at construction).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rpt.kernels.cpu.products import RowProducts, generating
from rpt.models.heads import ClusteredHead
from rpt.models.sampling import sample_next
from rpt.ops.stack.spec import at_least_fp32


class Decoder:
    def __init__(self, model, products: RowProducts | None = None):
        """`model`: a RecurrentLM (its head's part); `products`: packed products for the steps (the two-level
        head's decoding runs them, and `generate` puts the model's on them while it runs), or None: F.linear."""
        self.model, self.products = model, products
        linear = products if products is not None else F.linear
        self.two_level = TwoLevelDecoding(model.head, linear) if isinstance(model.head, ClusteredHead) else None

    @classmethod
    def on(cls, model, backend) -> "Decoder":
        """The decoder `rpt generate` runs: on the CPU the steps' products on the backend's packed one-row products
        (RowProducts), elsewhere F.linear."""
        cpu = next(model.parameters()).device.type == "cpu"
        return cls(model, RowProducts.of(backend) if cpu else None)

    def sampling_logits(self, h: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
        """The head's logits of final hidden states `h` for sampling among each row's k best tokens (1: greedy,
        0: all; one k or one per row): a two-level head leaves out the rarer tokens of the rows where they cannot
        be drawn (TwoLevelDecoding.for_sampling)."""
        return self.two_level.for_sampling(h, k) if self.two_level else self.model.head(h)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's most probable next token from final hidden states `h` [B, D] (a two-level head without the
        [B, vocabulary] logits: TwoLevelDecoding.greedy)."""
        return self.two_level.greedy(h) if self.two_level else self.model.head(h).argmax(dim=-1)

    def warm(self, rows: int) -> None:
        """Make now what decoding `rows` rows at once will use (a server's fixed memory then holds it)."""
        if self.two_level:
            self.two_level.warm(rows)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 reset_at: int | None = None, depth: int | None = None, exit=None,
                 shared: bool = False) -> Iterator[int]:
        """Yield new token ids one at a time. prompt: [T] int64. Memory does not grow with the length.
        `reset_at`: a token (the end of text) before which the state starts afresh, in the prompt and after it,
        as training resets it between documents. `depth`, `exit`, `shared`: a looped model's iterations per token,
        as RecurrentLM.step takes them (the prompt runs at `depth`). With `products`, the model's products run on
        them until the last token (the first `next` builds the native code) and their packings go after."""
        tokens = self._tokens(prompt, max_new_tokens, temperature, top_k, top_p, generator, reset_at, depth, exit,
                              shared)
        return tokens if self.products is None else generating(self.model, tokens, self.products)

    @torch.no_grad()
    def _tokens(self, prompt, max_new_tokens, temperature, top_k, top_p, generator, reset_at, depth, exit, shared):
        model = self.model
        was_training = model.training
        model.eval()
        try:
            x = prompt[None]
            logits, state = model.prefill(x, reset_mask=None if reset_at is None else x == reset_at, depth=depth,
                                          shared=shared)
            for _ in range(max_new_tokens):
                token = sample_next(logits, temperature, top_k, top_p, generator)
                yield int(token[0])
                if int(token[0]) == reset_at:
                    state = None  # a new document
                h, state = model.step_hidden(token, state, depth, exit, shared)
                logits = self.sampling_logits(h, 1 if temperature <= 0 else top_k)
        finally:
            model.train(was_training)


class TwoLevelDecoding:
    """A two-level head's (ClusteredHead's) decoding: the shortlist's product for every row, the whole matrix's
    only for rows whose rarer tokens can be drawn (sampling) or can win (greedy, screened in bfloat16 first)."""

    # The screen's error bound per unit of |h| |W_t| (rounding h and W to bfloat16, 2 x 2^-8, and their product's
    # float32 sum), and its output's per unit of |z'| (rounding to bfloat16: 2^-8, doubled); SLACK covers the
    # float32 rounding of the exact path's own comparison.
    SCREEN_INPUTS, SCREEN_OUTPUT, SLACK = 2 ** -7 + 2 ** -15, 2 ** -7, 1e-3

    def __init__(self, head: ClusteredHead, linear=F.linear):
        self.head, self.linear = head, linear
        self._held = None  # (the key of the matrix it was taken from, the shortlist's rows)
        self._screen = None  # (the matrix's key, the tail's rows in bfloat16, their largest norm)

    def _shortlist_weight(self) -> nn.Parameter:
        """The shortlist's rows of the matrix in `order`, kept for inference until the matrix or the order changes
        (an index_select per token cost a 32-row decode step a tenth of its time); a Parameter so that packed
        products keep their packing of it."""
        key = (self.head.weight.data_ptr(), self.head.weight._version, self.head.order._version)
        if self._held is None or self._held[0] != key:
            short = self.head.weight.detach().index_select(0, self.head.order[:self.head.shortlist])
            self._held = (key, nn.Parameter(short, requires_grad=False))
        return self._held[1]

    @torch.no_grad()
    def for_sampling(self, h: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
        """What the head gives, with the rarer tokens at -inf in the rows where sampling (rpt/models/sampling.py)
        cannot pick them: a row sampled among its k best tokens (`k`: one for all rows or one per row; 1: greedy,
        0: no limit) whose k-th best shortlist token is above the rarer-token entry (a rarer token's probability is
        at most that entry's). Every row runs the shortlist's product; only the others run the whole matrix's, for
        their rarer tokens. A row's result does not depend on the others'."""
        S, V = self.head.shortlist, self.head.vocab_size
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
        out.index_copy_(-1, self.head.order[:S], first[:, :S])
        if not bool(short.all()):
            rest = (~short).nonzero()[:, 0]
            rows = self._rarer_logits(flat[rest]).log_softmax(-1) + first[rest, S:]
            out.index_copy_(0, rest, rows.index_copy_(-1, self.head.order[:S], first[rest, :S]))
        return out.view(*h.shape[:-1], V)

    @torch.no_grad()
    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The most probable token of each row, as the argmax of `for_sampling(h, 1)` (but a tie between a
        shortlist token and a rarer one goes to the shortlist's): the best shortlist token, or for a row whose
        rarer-token entry outweighs it, the best rarer token where that one's probability is higher. No
        [rows, vocabulary] tensor is made (in a 32-row decode step its filling and argmax took a quarter of
        the step)."""
        S = self.head.shortlist
        flat = h.reshape(-1, h.shape[-1])
        first = self._first_level(flat)
        best, at = first[:, :S].max(dim=-1)
        ids = self.head.order[:S][at]
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
    def _screens(self, flat: torch.Tensor) -> bool:
        return (flat.device.type == "cpu" and flat.dtype == self.head.weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def _screen_weight(self) -> tuple[nn.Parameter, float]:
        key = (self.head.weight.data_ptr(), self.head.weight._version, self.head.order._version)
        if self._screen is None or self._screen[0] != key:
            tail = self.head.weight.detach().index_select(0, self.head.order[self.head.shortlist:])
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
        h = self.head.weight.new_zeros(rows, self.head.weight.shape[1])
        self.linear(h, self._shortlist_weight())
        self.linear(h, self.head.weight)
        if self._screens(h):
            tail, _ = self._screen_weight()
            self.linear(h.to(tail.dtype), tail)

    def _first_level(self, flat: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the shortlist's tokens and the rarer-token entry [rows, S + 1], for inference."""
        return self.head._head_logits(flat, self._shortlist_weight(), self.linear).log_softmax(-1)

    def _rarer_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """The rarer tokens' logits [rows, V] in token-id order, the shortlist's at -inf, for inference: one product
        with the whole matrix as it is (its packing is kept; a copy of the tail's rows would be another 30 MB at
        this size)."""
        shortlist = self.head.order[:self.head.shortlist]
        return at_least_fp32(self.linear(flat, self.head.weight)).index_fill_(-1, shortlist, -math.inf)

