"""Adaptive depth per token (rpt/models/loop_exit.py) and the shared state option: a batch whose rows exit at
different iterations gives, row by row and token by token, what that row alone gives at the fixed depth it ran;
shared state costs nothing at depth 1 and keeps one slot; bad exit rules are refused."""

from __future__ import annotations

import pytest
import torch

from rpt.errors import RptError
from rpt.models.loop_exit import Exit
from tests.models.test_loop import V, looped

T = 9


@pytest.mark.parametrize("criterion", ["kl", "shortlist", "change"])
def test_rows_exiting_at_different_iterations_equal_each_row_alone_at_its_depth(criterion):
    model = looped("mingru", head_shortlist=8, loop_inject="add").eval()
    x = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1))
    for threshold in (1e-2, 1e-3, 1e-5, 1e-7):  # a random model: its distributions differ little
        rule, state, logits, depths = Exit(criterion, threshold), None, [], []
        with torch.no_grad():
            for t in range(T):
                out, state = model.step(x[:, t], state, depth=7, exit=rule)
                logits.append(out)
                depths.append(rule.depths.clone())
        depths = torch.stack(depths, 1)  # [rows, T]
        if len(set(depths.flatten().tolist())) > 2:
            break
    else:
        pytest.fail(f"no threshold gave rows several depths for {criterion}")
    assert rule.iterations == int(depths.sum()) and rule.tokens == 4 * T
    assert int(depths.max()) <= 7 and int(depths.min()) >= (1 if criterion == "change" else 2)
    with torch.no_grad():
        for row in range(4):
            state = None
            for t in range(T):
                alone, state = model.step(x[row:row + 1, t], state, depth=int(depths[row, t]))
                torch.testing.assert_close(alone[0], logits[t][row], atol=1e-10, rtol=1e-10)


def test_a_rule_that_never_fires_runs_the_depth_given():
    model = looped("lstm", attention_every=0).eval()
    x = torch.randint(0, V, (2, T))
    state_a = state_b = None
    with torch.no_grad():
        for t in range(T):
            a, state_a = model.step(x[:, t], state_a, depth=5, exit=Exit("kl", 0.0))
            b, state_b = model.step(x[:, t], state_b, depth=5)
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_shared_state_keeps_one_slot_and_equals_the_exact_state_at_depth_one():
    model = looped("gru", loop_inject="add").eval()
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        for depth, same in ((1, True), (4, False)):
            exact = shared = None
            outs = []
            for t in range(T):
                a, exact = model.step(x[:, t], exact, depth=depth)
                b, shared = model.step(x[:, t], shared, depth=depth, shared=True)
                outs.append((a, b))
            close = all(torch.allclose(a, b, atol=1e-10, rtol=0) for a, b in outs)
            assert close == same
            core = shared[1:-1]  # prelude 1, core 2 blocks x slots, coda 1
            assert all(core[i] is core[i % 2] for i in range(len(core)))  # every slot the same objects


@pytest.mark.parametrize("text, message", [("kl", "no threshold"), ("depth:0.1", "not one of"),
                                           ("change:-1", "negative")])
def test_bad_exit_rules_are_refused_with_the_fix(text, message):
    with pytest.raises(RptError, match=message) as refused:
        Exit.parse(text)
    assert refused.value.fix


def test_the_shortlist_criterion_needs_a_clustered_head():
    model = looped("mingru").eval()
    with pytest.raises(RptError, match="no shortlist"):
        model.step(torch.zeros(1, dtype=torch.long), None, depth=3, exit=Exit("shortlist", 1e-3))
