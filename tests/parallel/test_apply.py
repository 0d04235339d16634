"""What rpt.parallel.apply does to a model from outside: activation checkpointing and compile."""

from __future__ import annotations

import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.parallel.apply import checkpoint_blocks

V = 50


def test_activation_checkpointing_changes_memory_not_results():
    """Recomputed blocks give the same logits and gradients (dropout replays its mask) and keep far less."""
    cfg = ModelConfig(cell="modlstm", vocab_size=V, d_model=32, n_layers=4, attention_every=2, attention_window=8,
                      mlp_ratio=2.0, dropout=0.2)
    x = torch.randint(0, V, (3, 24))

    def run(recompute: bool):
        torch.manual_seed(5)
        model = RecurrentLM(cfg).train()
        if recompute:
            checkpoint_blocks(model)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            logits, state = model(x)
        logits.pow(2).mean().backward()
        return logits.detach(), state, {n: p.grad for n, p in model.named_parameters()}, sum(saved)

    logits, state, grads, kept = run(False)
    logits_r, state_r, grads_r, kept_r = run(True)
    assert torch.equal(logits, logits_r)
    for a, b in zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(state_r)):
        assert torch.equal(a, b)
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], rtol=0, atol=0, msg=name)
    assert kept_r < 0.25 * kept, (kept_r, kept)
