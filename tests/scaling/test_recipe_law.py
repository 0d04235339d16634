"""The default recipe sized from a scaling law (`recipe.law`): the ladder's size of least predicted loss at the
budget, said with the prediction; a larger budget never predicts a worse model; a law of another family is said
and left unused."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from rpt.errors import RptError
from rpt.scaling.fit import Law3, effective_tokens
from rpt.scaling.law import Group, Law
from rpt.train import recipe

TRUTH = Law3(0.9, 40.0, 0.35, 300.0, 0.4)


def group(family="lstm", vocab=512):
    return Group(family, vocab, 64, TRUTH, {}, [], None)


def write_law(path, family="lstm"):
    Law([group(family)], {"rpt_commit": "abc1234", "corpora": {"stdlib": {}}, "points_fitted": 15,
                          "budgets_fitted": [1e13, 3e13, 1e14], "machine": "a test"}, []).save(path)
    return path


def test_the_size_is_the_ladder_s_least_predicted_loss_and_monotone_in_the_budget():
    flops = {s: 6 * recipe.lstm_params(*s) + 5e6 for s in recipe.LADDER}
    params = {s: recipe.lstm_params(*s) for s in recipe.LADDER}
    unique, predicted = 3_000_000, []
    for budget in (1e13, 3e13, 1e14, 3e14, 1e15, 1e16):
        facts = {}
        c = {x.key: x for x in recipe.choose(unique, 100_000, {"flops": budget}, dict.fromkeys(recipe.LADDER, 1.0),
                                             4096, frozenset(), facts=facts, params=params, flops=flops, law=group())}
        size = (c["model.n_layers"].value, c["model.d_model"].value)
        loss = {s: float(TRUTH.loss(params[s], effective_tokens(budget / flops[s], unique))) for s in recipe.LADDER}
        assert size == min(loss, key=loss.get)
        assert facts["predicted"][0] == pytest.approx(loss[size])
        assert f"{loss[size]:.3f} bits per byte" in c["model.d_model"].why and "next:" in c["model.d_model"].why
        predicted.append(loss[size])
    assert all(b <= a for a, b in zip(predicted, predicted[1:]))  # a larger budget never predicts worse
    assert len({p for p in predicted}) == len(predicted)


def resolved(make_cfg, law, given=()):
    cfg = make_cfg("train.max_steps=0", "train.max_flops=2e12", "train.recipe=auto", f"recipe.law={law}",
                   "model.attention_every=0").thawed()
    cfg.given = frozenset(given)
    recipe.apply_recipe(cfg, SimpleNamespace(rank=0, world_size=1, device="cpu"), 10**6, 10_000, np.ones(512))
    return cfg


def test_rpt_train_s_recipe_reads_the_law_and_says_where_it_came_from(make_cfg, tmp_path):
    cfg = resolved(make_cfg, write_law(tmp_path / "law.json"))
    notes = "\n".join(cfg.notes)
    assert "sized by the scaling law" in notes and "abc1234" in notes and "scaling law predicts" in notes
    other = resolved(make_cfg, write_law(tmp_path / "gru.json", "gru"))
    notes = "\n".join(other.notes)
    assert "holds no lstm runs" in notes and "the widest size that sees" in notes
    mine = resolved(make_cfg, tmp_path / "law.json", given={"model.d_model", "model.n_layers"})
    assert mine.model.d_model == 32  # a size given is the user's, whatever the law says
    with pytest.raises(RptError, match="no such file"):
        make_cfg(f"recipe.law={tmp_path / 'none.json'}")


def test_under_a_time_budget_the_law_s_choice_is_timed_too(make_cfg, tmp_path, monkeypatch):
    """A token's seconds are not proportional to its FLOPs on a CPU (a small model's time is mostly elsewhere):
    the law's choice is timed beside the reference size, and the speeds of every size follow the line through
    both; the choice made on them is the law's least loss at the true speeds."""
    timed, a, b = [], 2e-4, 2e-11  # seconds a token: a share beside the products, and per FLOP

    def measure_speed(cfg, size, device, counts, limit):
        timed.append((size, cfg.train.batch_size))
        return 1 / (a + b * recipe.flops_of(cfg.model, size, counts)), True

    monkeypatch.setattr(recipe, "measure_speed", measure_speed)
    cfg = make_cfg("train.max_steps=0", "train.max_time=600", "train.recipe=auto", "model.attention_every=0",
                   f"recipe.law={write_law(tmp_path / 'law.json')}").thawed()
    cfg.given = frozenset()
    unique = 10**6
    recipe.apply_recipe(cfg, SimpleNamespace(rank=0, world_size=1, device="cpu"), unique, 10_000, np.ones(512))
    assert timed[0][0] == recipe.Timing.REFERENCE and len({s for s, _ in timed}) >= 2 and len(set(timed)) == len(timed)
    model = dataclasses.replace(cfg.model, vocab_size=512)

    def flops(size):
        return recipe.flops_of(model, size, np.ones(512))

    def loss(size, speed):
        tokens = recipe.tokens_of({"seconds": 600}, speed(size), 0)
        return float(TRUTH.loss(recipe.recurrent_params(model, size), effective_tokens(tokens, unique)))

    def true(size):
        return 1 / (a + b * flops(size))

    def one_flop_rate(size):  # the reference size's FLOP/s for every size
        return true(recipe.Timing.REFERENCE) * flops(recipe.Timing.REFERENCE) / flops(size)
    best = min(recipe.LADDER, key=lambda s: loss(s, true))
    assert (cfg.model.n_layers, cfg.model.d_model) == best != min(recipe.LADDER, key=lambda s: loss(s, one_flop_rate))
