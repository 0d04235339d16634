"""Exact BPTT in recomputed chunks (train.bptt_chunk, rpt/parallel/bptt.py): for every cell, with an attention block,
an MLP, document resets inside the window and a carried state, the chunked window gives the plain backward's
losses, final state and gradients (float64); without gradients it gives the same losses; a chunk that does not
divide the window is refused."""

from __future__ import annotations

import pytest
import torch

from rpt.config import ModelConfig, TrainConfig
from rpt.errors import RptError
from rpt.models.lm import RecurrentLM
from rpt.parallel.bptt import chunk_windows

V, B, T = 50, 2, 48


def model_of(cell: str, chunk: int = 0) -> RecurrentLM:
    """The same model each call; with `chunk`, its windows run in chunks."""
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, n_layers=2, d_model=16, vocab_size=V, attention_every=2,
                                    attention_window=8, attention_heads=2, mlp_ratio=2, dropout=0.0)).double()
    if chunk:
        chunk_windows(model, chunk)
    return model


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm", "mingru", "minlstm", "mlstm", "gdn"])
def test_chunks_give_the_plain_backwards_losses_state_and_gradients(cell):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, 20], reset[1, 33] = True, True  # a document starts inside a chunk
    with torch.no_grad():
        _, state = model_of(cell)(x[:, :9], targets=y[:, :9])  # a carried state, not the fresh one
    results = []
    for chunk in (0, 16, 12):
        model = model_of(cell, chunk)
        nats, new = model(x, state, reset, y)
        nats.sum().backward()
        results.append((nats.detach(), new, {n: p.grad.clone() for n, p in model.named_parameters()}))
    plain = results[0]
    for nats, new, grads in results[1:]:
        torch.testing.assert_close(nats, plain[0], atol=1e-10, rtol=1e-10)
        for a, b in zip(torch.utils._pytree.tree_leaves(new), torch.utils._pytree.tree_leaves(plain[1])):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        assert grads.keys() == plain[2].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain[2][name], atol=1e-9, rtol=1e-8, msg=lambda m: f"{name}: {m}")


def test_without_gradients_the_chunks_run_one_after_another():
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    with torch.no_grad():
        plain, _ = model_of("lstm")(x, targets=y)
        chunked, _ = model_of("lstm", 16)(x, targets=y)
    torch.testing.assert_close(chunked, plain, atol=1e-10, rtol=1e-10)


def test_a_chunk_that_does_not_divide_the_window_is_refused_with_the_fix():
    with pytest.raises(RptError, match="does not divide") as refused:
        TrainConfig(seq_len=64, bptt_chunk=24).check()
    assert "train.bptt_chunk = 16" in refused.value.fix


def test_a_looped_model_in_chunks_gives_the_plain_backwards_gradients_at_the_steps_depth():
    """Depth recurrence: one depth for the whole window (every chunk runs it), the state holding every
    (iteration, block) slot from chunk to chunk."""
    def looped(chunk: int = 0) -> RecurrentLM:
        torch.manual_seed(0)
        model = RecurrentLM(ModelConfig(cell="lstm", n_layers=3, d_model=16, vocab_size=V, loop_prelude=1,
                                        loop_core=1, loop_backprop=2, dropout=0.0)).double()
        if chunk:
            chunk_windows(model, chunk)
        return model

    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    results = []
    for chunk in (0, 16):
        model = looped(chunk)
        nats, _ = model(x, targets=y, depth=3)
        nats.sum().backward()
        results.append((nats.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (chunked, grads) = results
    torch.testing.assert_close(chunked, plain, atol=1e-10, rtol=1e-10)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-9, rtol=1e-8, msg=lambda m: f"{name}: {m}")


def test_under_bf16_autocast_the_chunks_agree_with_the_plain_backward_to_its_precision():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    found = []
    for chunk in (0, 16):
        model = model_of("lstm", chunk).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nats, _ = model(x, targets=y)
        nats.sum().backward()
        found.append((nats.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (chunked, grads) = found
    torch.testing.assert_close(chunked, plain, atol=2e-2, rtol=0)
    scale = max(float(g.abs().max()) for g in plain_grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=2e-2 * scale, rtol=0, msg=lambda m: f"{name}: {m}")


def test_a_chunked_bf16_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(cut_and_resumed):
    """The carried state and the optimiser travel in the checkpoint: cut at step 3 and resumed, bit-identical."""
    full, resumed = cut_and_resumed("train.bptt_chunk=4", "train.precision=bf16", "train.schedule=constant",
                                    "train.warmup_steps=0")
    resumed.run()
    for a, b in zip(full.runner.model.parameters(), resumed.runner.model.parameters()):
        assert torch.equal(a, b)


def test_activation_checkpointing_inside_the_chunks_keeps_the_plain_backwards_gradients():
    from rpt.parallel.apply import checkpoint_blocks

    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    grads = []
    for chunk, recompute in ((0, False), (16, True)):
        model = model_of("lstm", chunk)
        if recompute:
            checkpoint_blocks(model)
        nats, _ = model(x, targets=y)
        nats.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], atol=1e-9, rtol=1e-8, msg=lambda m: f"{name}: {m}")
