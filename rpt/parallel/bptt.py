"""Exact backpropagation through a long window in memory that does not grow with it (`train.bptt_chunk`).

The window runs chunk by chunk in time through the whole model (embedding, every block, the head's loss), each
chunk under torch's non-reentrant activation checkpointing: a step keeps the state at chunk boundaries and, in
backward, one chunk's activations at a time, recomputed from its boundary state. The state's gradient flows from
chunk to chunk as in the plain backward, so the gradients are the plain backward's (with dropout off: a chunk draws
its masks in another order). Each chunk computes its own tokens' losses, so no [T, vocab] logits exist at once;
without gradients (validation) the chunks simply run one after another. Applied from outside the model, as
activation checkpointing is (rpt/parallel/apply.py), and inside the one forward that DDP and FSDP see.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def chunk_windows(model, chunk: int) -> None:
    """Make `model(x, state, reset, targets, ...)` (a RecurrentLM, before data parallelism wraps it) run a window
    longer than `chunk` tokens in chunks, when it computes the losses; anything else runs as before."""
    plain = model.forward

    def forward(x, state=None, reset_mask=None, targets=None, **kw):
        if targets is None or x.shape[1] <= chunk:
            return plain(x, state, reset_mask, targets, **kw)
        state = state if state is not None else model.init_state(x.shape[0], x.device)
        return chunked_nats(lambda *a: plain(*a, **kw), x, state, reset_mask, targets, chunk)

    model.forward = forward


def chunked_nats(run, x: torch.Tensor, state: list, reset, targets: torch.Tensor, chunk: int):
    """`run(x, state, reset, targets) -> (nats, state)` over the window x [B, T] in chunks of `chunk` tokens:
    (nats [B, T], the state after the window)."""
    nats = []
    for t in range(0, x.shape[1], chunk):
        part = slice(t, t + chunk)
        args = (x[:, part], state, None if reset is None else reset[:, part], targets[:, part])
        if torch.is_grad_enabled():
            n, state = checkpoint(run, *args, use_reentrant=False)
        else:
            n, state = run(*args)
        nats.append(n)
    return torch.cat(nats, 1), state
