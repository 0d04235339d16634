"""The stack around the recurrent cells, in plain torch: the maths of rpt's blocks and heads that is not a cell's
step. rpt's model (rpt/models) runs these functions, and `rpt export` ships this file beside modeling_rpt.py (as
spec_stack.py), so the exported model's attention, MLP, heads and loop are rpt's own, not a copy that can drift.
It imports torch alone.

    block_diagonal           a head-wise recurrent matrix, from its blocks
    sliding_window_attention causal attention over the last `window` positions of one document; its state is the
                             last window's keys and values (constant memory per token, as a cell's state)
    gated_mlp                down(silu(a) * b), (a, b) = up(x)
    clustered_log_probs      the two-level softmax's log-probabilities over the whole vocabulary
    inject                   the depth loop's input to each iteration: adapter(cat(h, e)), or h + e
"""

import torch
import torch.nn.functional as F


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Softmax and loss in float32 whatever the autocast dtype (float64 stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def block_diagonal(w: torch.Tensor, groups: int, heads: int) -> torch.Tensor:
    """The dense [groups * H, H] recurrent matrix of a head-wise one kept as its blocks, [groups * H, H / heads]:
    in each gate group the rows of head j read only head j's part of the state, as xLSTM's sLSTM does. The
    reference and CPU paths multiply by the dense matrix; a kernel may read the blocks directly."""
    if heads == 1:
        return w
    d = w.shape[1]
    blocks = w.view(groups, heads, d, d)
    return torch.cat([torch.block_diag(*blocks[g].unbind(0)) for g in range(groups)])


def sliding_window_attention(x, state, reset, qkv, out, n_heads: int, window: int):
    """x [B, T, D] from `state` (keys [B, W, D], values [B, W, D], valid [B, W]: the last W positions, and which of
    them belong to the current document); `reset` [B, T] (or None) opens a new document before a position; `qkv`
    and `out`: the projections (bias-free linear maps, as modules: generation swaps their products). Each position
    attends to itself and the W - 1 before it within its document. Returns (y [B, T, D], the new state)."""
    B, T, D = x.shape
    W, nh = window, n_heads
    k_cache, v_cache, valid = state
    q, k, v = qkv(x).split(D, dim=-1)
    keys, values = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)  # [B, W+T, D]
    # Document of every position: cached keys are document 0 while valid; each reset opens a new one.
    resets = reset.long() if reset is not None else torch.zeros(B, T, dtype=torch.long, device=x.device)
    doc_new = resets.cumsum(1)
    doc_cache = torch.where(valid > 0, 0, -1).to(doc_new.dtype)
    doc_all = torch.cat([doc_cache, doc_new], 1)  # [B, W+T]
    pos_q = torch.arange(T, device=x.device)[:, None] + W
    pos_k = torch.arange(W + T, device=x.device)[None, :]
    in_window = (pos_k <= pos_q) & (pos_k > pos_q - W)  # [T, W+T]
    mask = in_window[None] & (doc_all[:, None, :] == doc_new[:, :, None])  # [B, T, W+T]
    heads = lambda t: t.view(B, -1, nh, D // nh).transpose(1, 2)  # noqa: E731
    y = F.scaled_dot_product_attention(heads(q), heads(keys), heads(values), attn_mask=mask[:, None])
    y = out(y.transpose(1, 2).reshape(B, T, D))
    new_valid = (doc_all[:, -W:] == doc_new[:, -1:]).to(valid.dtype)
    return y, (keys[:, -W:], values[:, -W:], new_valid)


def gated_mlp(x: torch.Tensor, up, down) -> torch.Tensor:
    """`up` and `down`: the bias-free linear maps (modules: generation swaps their products)."""
    a, b = up(x).chunk(2, dim=-1)
    return down(F.silu(a) * b)


def clustered_log_probs(h, weight, rest_weight, rest_bias, order, shortlist: int) -> torch.Tensor:
    """The two-level softmax's log-probabilities over the whole vocabulary, in token-id order: the `shortlist`
    tokens first in `order` and one "rarer token" entry (rest_weight, rest_bias) normalised together, the rarer
    tokens among themselves and scaled by that entry. One product with the matrix as it is (not copied into
    shortlist order, which cost generation four times the product)."""
    z, rest = at_least_fp32(F.linear(h, weight)), at_least_fp32(F.linear(h, rest_weight, rest_bias))
    short = torch.zeros(weight.shape[0], dtype=torch.bool, device=z.device)
    short[order[:shortlist]] = True
    first = torch.logsumexp(torch.cat([z.masked_fill(~short, float("-inf")), rest], dim=-1), -1, keepdim=True)
    tail = torch.logsumexp(z.masked_fill(short, float("-inf")), -1, keepdim=True)
    return torch.where(short, z - first, z - tail + rest - first)


def inject(h: torch.Tensor, e: torch.Tensor, adapter) -> torch.Tensor:
    """The depth loop's input to each iteration of its core from the state h and the prelude's output e;
    `adapter`: the linear map of cat(h, e) (a module), or None for h + e."""
    return adapter(torch.cat([h, e], dim=-1)) if adapter is not None else h + e
