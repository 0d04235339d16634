"""Depth recurrence (rpt/models/loop.py): the looped model's forms agree (the step form with the exact
per-iteration state equals the sequence form; a window split in two with the state carried equals the whole),
the unreached iterations' state rule, gradients only through the last k iterations, the training draw, the FLOP
count, and the configurations refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.lm import RecurrentLM, part_names
from rpt.models.loop import draw_depth, mean_depths

V, T = 40, 11


def looped(cell="lstm", **kw) -> RecurrentLM:
    options = dict(cell=cell, n_layers=4, d_model=16, vocab_size=V, loop_prelude=1, loop_core=2, loop_mean=3,
                   loop_backprop=2, attention_every=3, attention_window=4, attention_heads=2, loop_inject="linear")
    options.update(kw)
    cfg = ModelConfig(**options)
    cfg.check()
    torch.manual_seed(0)
    return RecurrentLM(cfg).double()


@pytest.mark.parametrize("cell", ["lstm", "mingru", "modlstm", "mlstm", "gdn"])
def test_the_step_form_with_the_exact_state_equals_the_sequence_form(cell):
    model = looped(cell)
    x = torch.randint(0, V, (2, T))
    for depth in (1, 3, 7):  # 7: more than training's mean
        logits, _ = model(x, depth=depth)
        state, steps = None, []
        for t in range(T):
            step_logits, state = model.step(x[:, t], state, depth=depth)
            steps.append(step_logits)
        torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=1e-10)


def test_a_window_split_in_two_with_the_state_carried_equals_the_whole():
    model = looped("gru", loop_inject="add")
    x = torch.randint(0, V, (3, T))
    reset = torch.zeros(3, T, dtype=torch.bool)
    reset[1, 6] = True
    whole, _ = model(x, reset_mask=reset, depth=4)
    first, state = model(x[:, :5], reset_mask=reset[:, :5], depth=4)
    second, _ = model(x[:, 5:], state, reset[:, 5:], depth=4)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(model(x, depth=2)[0], whole)  # the depth changes the model's output


def test_iterations_a_step_did_not_reach_take_the_deepest_reached_state():
    model = looped("lstm", attention_every=0)  # prelude 1, core 2, coda 1; slots: loop_cap = 12
    x = torch.randint(0, V, (2, T))
    _, state = model(x, depth=3)
    assert len(state) == 1 + 2 * model.cfg.loop_cap + 1
    slots = [state[1 + 2 * i:3 + 2 * i] for i in range(model.cfg.loop_cap)]
    deepest = slots[2]
    assert not torch.equal(slots[0][0][0][0], deepest[0][0][0])  # iterations differ
    for slot in slots[3:]:
        for a, b in zip(slot, deepest):
            torch.testing.assert_close(a[0][0], b[0][0], atol=0, rtol=0)
    _, longer = model(x, state, depth=14)  # beyond the slots: the state grows to the depth run
    assert len(longer) == 1 + 2 * 14 + 1


def test_gradients_flow_through_the_last_k_iterations_only():
    x, y = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T))
    grads, losses, kept = [], [], []
    for k in (1, 5):
        model = looped("mingru", loop_backprop=k, attention_every=0, tie_embeddings=False)
        calls = []  # for each call of a core block: whether its output is in the backward's graph
        for i in (1, 2):
            model.blocks[str(i)].register_forward_hook(lambda m, a, out: calls.append(out[0].requires_grad))
        nats, _ = model(x, targets=y, depth=5)
        nats.mean().backward()
        losses.append(nats.mean().detach())
        kept.append(calls)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert kept == [[False] * 8 + [True] * 2, [True] * 10]  # 5 iterations x 2 core blocks; the last k with grad
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)  # the forward is the same
    torch.testing.assert_close(grads[0]["head.weight"], grads[1]["head.weight"], atol=1e-12, rtol=0)
    assert set(grads[0]) == set(grads[1])  # every parameter learns either way, but from k iterations
    assert not torch.allclose(grads[0]["blocks.0.cell.in_proj.weight"], grads[1]["blocks.0.cell.in_proj.weight"])


def test_the_training_draw_is_a_function_of_seed_and_step_with_the_configured_mean():
    cfg = ModelConfig(n_layers=3, loop_core=1, loop_mean=4)
    draws = [draw_depth(cfg, 7, step) for step in range(4000)]
    assert draws[:50] == [draw_depth(cfg, 7, step) for step in range(50)]  # replayed exactly
    assert draws[:50] != [draw_depth(cfg, 8, step) for step in range(50)]
    assert 1 <= min(draws) and max(draws) <= cfg.loop_cap == 16
    assert np.mean(draws) == pytest.approx(4.0, abs=0.15) and len(set(draws)) > 5
    uniform = ModelConfig(n_layers=3, loop_core=1, loop_mean=4, loop_sampler="uniform")
    assert set(draw_depth(uniform, 0, s) for s in range(500)) == set(range(1, 8))
    assert {draw_depth(ModelConfig(n_layers=3, loop_core=1, loop_mean=3, loop_sampler="fixed"), 0, s)
            for s in range(20)} == {3}
    assert mean_depths(cfg)[1] < 2.0  # min(r, k = 2): r = 1 is drawn too


def test_flops_count_the_core_at_the_mean_depth_forward_and_k_backward():
    plain = looped("lstm", loop_core=0, loop_prelude=0, loop_mean=4.0, loop_inject="add", attention_every=0)
    model = looped("lstm", loop_sampler="fixed", loop_mean=3, loop_backprop=2, loop_inject="add",
                   attention_every=0)
    block = plain.blocks["1"].flops_per_token()
    assert plain.flops_per_token(training=False) + 2 * 2 * block == model.flops_per_token(training=False)
    assert model.flops_per_token() == 3 * plain.flops_per_token(training=False) + 2 * block * (3 + 2 * 2 - 3)


def test_the_loop_is_off_by_default_and_adds_nothing_then():
    cfg = ModelConfig(n_layers=2, vocab_size=V)
    assert "loop" not in part_names(cfg) and RecurrentLM(cfg).loop is None
    assert "loop" in part_names(ModelConfig(n_layers=2, vocab_size=V, loop_core=1))


@pytest.mark.parametrize("options, message", [
    (dict(loop_prelude=2, loop_core=3), "more than model.n_layers"),
    (dict(loop_core=1, loop_backprop=9, loop_max=8), "above the cap"),
    (dict(loop_core=1, loop_mean=1.0), "Poisson-lognormal"),
    (dict(loop_core=1, loop_mean=20, loop_max=8), "above the cap on the depth, model.loop_max = 8"),
])
def test_bad_loop_configurations_are_refused_with_the_fix(options, message):
    with pytest.raises(RptError, match=message) as refused:
        ModelConfig(n_layers=4, **options).check()
    assert refused.value.fix
