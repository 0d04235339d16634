"""The optimisers: SGD with momentum steps as torch's reference SGD does, skipped steps included (the first
one too), and takes no weight decay; AdamW decays only the matrices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rpt.config import Config
from rpt.errors import RptError
from rpt.models import RecurrentLM
from rpt.train.optim import build_optimizer
from rpt.parallel.runner import step_unless


def model_and_grads(cfg: Config, seed: int = 0):
    torch.manual_seed(seed)
    model = RecurrentLM(dataclasses.replace(cfg.model, vocab_size=300))
    x = torch.randint(0, 300, (2, 9))
    logits, _ = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    return model


def test_sgd_with_momentum_equals_torch_reference_sgd_with_a_skipped_first_step(make_cfg):
    cfg = make_cfg("train.optimizer=sgd", "train.lr=0.5", "train.momentum=0.9", "train.weight_decay=0.1")
    model = model_and_grads(cfg)
    reference = model_and_grads(cfg)  # the same weights and gradients
    optimizer = build_optimizer(model, cfg.train)
    skip, take = torch.tensor(True), torch.tensor(False)
    step_unless(optimizer, skip)  # fused SGD makes its momentum buffers here without writing them
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    expected = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)  # the for-loop form, no decay
    for _ in range(3):
        step_unless(optimizer, take)
        expected.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert not torch.equal(next(model.parameters()), next(model_and_grads(cfg).parameters()))  # it moved


def test_sgd_takes_no_weight_decay_and_adamw_decays_only_matrices(make_cfg):
    for name, moves in (("sgd", set()), ("adamw", {"blocks.0.cell.w_ih", "blocks.0.cell.w_hh"})):
        cfg = make_cfg(f"train.optimizer={name}", "train.lr=0.1", "train.weight_decay=0.5")
        model = model_and_grads(cfg)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # only a decay can move a weight now
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        step_unless(build_optimizer(model, cfg.train), torch.tensor(False))
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert moves <= moved and not any("embed" in n or "norm" in n for n in moved), (name, moved)
        assert (not moved) if name == "sgd" else moved


def test_momentum_outside_its_range_is_refused(make_cfg):
    with pytest.raises(RptError, match="train.momentum"):
        make_cfg("train.optimizer=sgd", "train.momentum=1.0")


def test_an_sgd_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(cut_and_resumed):
    """The momentum buffers travel in the checkpoint: cut at step 3 and resumed, the weights end bit-identical."""
    full, resumed = cut_and_resumed("train.optimizer=sgd", "train.lr=0.5", "train.schedule=constant",
                                    "train.warmup_steps=0")
    assert any(s["momentum_buffer"].abs().sum() > 0 for s in resumed.runner.optimizer.state.values())
    resumed.run()
    for a, b in zip(full.runner.model.parameters(), resumed.runner.model.parameters()):
        assert torch.equal(a, b)
