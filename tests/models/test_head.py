"""The output heads: the two-level softmax against its definition written out, its cheap loss against its full
log-probabilities (values and gradients), the shortlist it assigns, and the model and trainer that carry it."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.decoder import Decoder, TwoLevelDecoding
from rpt.models.heads import ClusteredHead, Head
from rpt.data.dataset import token_counts

V, D, S = 40, 8, 6


def clustered(seed: int = 0) -> ClusteredHead:
    torch.manual_seed(seed)
    head = ClusteredHead(D, V, S).double()
    torch.nn.init.normal_(head.rest.weight)
    counts = np.random.default_rng(seed).zipf(1.5, size=V * 50) % V  # a skewed corpus, shuffled ids
    head.assign(np.bincount(counts, minlength=V))
    return head


def test_the_two_level_softmax_is_its_definition():
    head = clustered()
    h = torch.randn(3, D, dtype=torch.float64)
    W, order = head.weight.detach(), head.order.tolist()
    short, tail = order[:S], order[S:]
    for i in range(3):
        first = torch.softmax(torch.cat([W[short] @ h[i], head.rest(h[i]).detach()]), 0)
        second = torch.softmax(W[tail] @ h[i], 0)
        want = torch.empty(V, dtype=torch.float64)
        want[short], want[tail] = first[:S], first[S] * second
        torch.testing.assert_close(head(h[i:i + 1]).detach().exp()[0], want)
    assert torch.allclose(head(h).exp().sum(-1), torch.ones(3, dtype=torch.float64))


def test_nats_equal_the_full_log_probabilities_in_value_and_gradient():
    head = clustered(1)
    h = torch.randn(5, 7, D, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (5, 7))
    rank = {t: r for r, t in enumerate(head.order.tolist())}
    assert 0 < sum(rank[t] >= S for t in y.flatten().tolist()) < y.numel()  # both levels have targets
    nats = head.nats(h, y)
    want = -head(h).gather(-1, y[..., None]).squeeze(-1)
    torch.testing.assert_close(nats, want)
    grads = torch.autograd.grad(nats.sum(), [h, head.weight, head.rest.weight])
    wants = torch.autograd.grad(want.sum(), [h, head.weight, head.rest.weight])
    for got, expected in zip(grads, wants):
        torch.testing.assert_close(got, expected)


def test_only_shortlist_targets_need_no_tail():
    head = clustered(2)
    y = head.order[:S].repeat(2)[None]
    h = torch.randn(1, y.shape[1], D, dtype=torch.float64)
    torch.testing.assert_close(head.nats(h, y), -head(h).gather(-1, y[..., None]).squeeze(-1))


def test_assign_puts_the_most_frequent_tokens_in_the_shortlist():
    tokens = np.array([5] * 50 + [3] * 40 + [9] * 30 + [1] * 5 + [2] * 5 + list(range(V)), dtype=np.uint16)
    head = ClusteredHead(D, V, 3)
    counts = token_counts(tokens, V)
    head.assign(counts)
    assert head.order[:3].tolist() == [5, 3, 9]
    assert head.tail_share == pytest.approx((len(tokens) - 123) / len(tokens))
    assert sorted(head.order.tolist()) == list(range(V))
    assert token_counts(tokens, V, sample=len(tokens) // 4).sum() == pytest.approx(len(tokens) / 4, abs=2)


def test_the_full_head_nats_are_the_cross_entropy():
    torch.manual_seed(0)
    head = Head(D, V)
    h, y = torch.randn(2, 3, D), torch.randint(0, V, (2, 3))
    torch.testing.assert_close(head.nats(h, y).mean(), F.cross_entropy(head(h).flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("tie", [True, False])
def test_the_model_with_a_shortlist_steps_as_it_runs_and_scores_as_it_samples(tie):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(vocab_size=V, d_model=D, n_layers=2, head_shortlist=S,
                                    tie_embeddings=tie)).double().eval()
    model.head.assign(np.arange(V)[::-1] + 1)
    assert (model.head.weight is model.embed.weight) == tie
    x = torch.randint(0, V, (2, 9))
    log_probs, _ = model(x)
    nats, _ = model(x[:, :-1], targets=x[:, 1:])
    torch.testing.assert_close(nats, -log_probs[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1))
    state = None
    for t in range(9):
        out, state = model.step(x[:, t], state)
        torch.testing.assert_close(out, log_probs[:, t])
    assert len(list(Decoder(model).generate(x[0], 5))) == 5
    assert "head.order" in model.state_dict()


def test_a_run_with_a_shortlist_learns_and_resumes_with_its_order(make_cfg, tmp_path, solo):
    from rpt.data.dataset import PreparedData
    from rpt.train.checkpoint.store import CheckpointStore
    from rpt.train.trainer import Trainer

    cfg = make_cfg("model.head_shortlist=32", "train.max_steps=30", "train.lr=1e-2")
    summary = Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    counts = token_counts(PreparedData(cfg.data.path).tokens("train"), 300)
    model = RecurrentLM(dataclasses.replace(cfg.model, vocab_size=300))
    checkpoints = CheckpointStore(str(tmp_path / "r" / "checkpoints"))
    checkpoints.load(checkpoints.find("latest", str(tmp_path / "r")), model)
    assert set(model.head.order[:32].tolist()) == set(np.argsort(-counts, kind="stable")[:32].tolist())
    assert summary["val_loss"] < np.log(300) - 1.0  # learned well beyond a uniform guess


def test_sampling_leaves_out_the_rarer_tokens_only_where_they_cannot_be_drawn():
    from rpt.models.sampling import sample_next

    head = clustered(3)
    decoding = TwoLevelDecoding(head)
    h = torch.randn(64, D, dtype=torch.float64) * 3
    full = head(h).detach()
    skipped = 0
    for temperature, top_k in ((0.0, 0), (0.8, 2), (1.0, 5), (1.0, 0), (0.7, S + 1)):
        for row in range(64):
            got = decoding.for_sampling(h[row:row + 1], 1 if temperature <= 0 else top_k).detach()
            if torch.isinf(got).any():  # the rarer tokens left out: the shortlist's values are forward's
                skipped += 1
                assert temperature == 0 or 0 < top_k <= S
                shortlist = head.order[:S]
                torch.testing.assert_close(got[0, shortlist], full[row, shortlist])
            else:
                torch.testing.assert_close(got, full[row:row + 1])
            draws = [sample_next(x, temperature, top_k, 0.9, torch.Generator().manual_seed(seed))
                     for x in (got, full[row:row + 1]) for seed in range(3)]
            assert draws[:3] == draws[3:]  # the same tokens from the same seeds
    assert 10 < skipped < 4 * 64  # both ways taken


def test_greedy_takes_the_argmax_of_the_whole_distribution_without_making_it():
    """TwoLevelDecoding.greedy: each row's best token over the whole vocabulary (the shortlist's or, where the
    rarer-token entry outweighs it, possibly a rarer one), as forward's argmax, whatever rows run beside it."""
    head = clustered(3)
    decoding = TwoLevelDecoding(head)
    h = torch.randn(256, D, dtype=torch.float64) * 3
    full = head(h).detach()
    got = decoding.greedy(h)
    assert torch.equal(got, full.argmax(-1))
    assert torch.equal(got, decoding.for_sampling(h, 1).argmax(-1))
    rare = ~torch.isin(got, head.order[:S])
    assert 0 < int(rare.sum()) < len(h), "both ways taken"
    assert torch.equal(torch.cat([decoding.greedy(h[i:i + 1]) for i in range(len(h))]), got)


def screened_head() -> ClusteredHead:
    """A float32 head of demo-like scales (rows of norm ~1.6, hidden states of norm ~20 as after RMSNorm) whose
    rarer-token entry outweighs the best shortlist token in many rows: the greedy screen's ground."""
    torch.manual_seed(0)
    head = ClusteredHead(256, 4096, 512)
    torch.nn.init.normal_(head.weight, std=0.1)
    torch.nn.init.normal_(head.rest.weight, std=0.1)
    torch.nn.init.constant_(head.rest.bias, 4.0)
    head.assign(np.bincount(np.random.default_rng(0).zipf(1.3, size=200_000) % 4096, minlength=4096))
    if not TwoLevelDecoding(head)._screens(head.weight):
        pytest.skip("no bfloat16 products on this CPU: the screen does not run")
    return head.eval()


@pytest.mark.parametrize("packed", [False, True])
def test_the_greedy_screen_bounds_each_rows_best_rarer_token_from_above(packed):
    """TwoLevelDecoding._rarer_may_win: its bfloat16 bound on the best rarer token's log-probability within its level
    is never below the exact one (float64), on F.linear and on the server's packed products, and it rules out
    most rows a margin of two nats above it."""
    from rpt.kernels.cpu.products import RowProducts

    head = screened_head()
    # (packed: three rows or more, bfloat16: oneDNN's product only)
    decoding = TwoLevelDecoding(head, RowProducts(None) if packed else F.linear)
    h = torch.randn(200, 256) * 1.25
    tail = head.weight.detach().double()[head.order[head.shortlist:]]
    z = h.double() @ tail.T
    exact = (z.max(-1).values - z.logsumexp(-1)).float()
    with torch.no_grad():
        assert bool(decoding._rarer_may_win(h, exact - 1e-5).all())
        ruled_out = ~decoding._rarer_may_win(h, exact + 2.0)
    assert int(ruled_out.sum()) > 0.9 * len(h)


def test_greedy_with_the_screen_picks_what_the_exact_path_picks():
    """In float32 with the screen (most uncertain rows ruled out by it) greedy gives float64's tokens but where
    two of them are within 1e-4 in log-probability; rarer tokens win in some rows, and each row alone is the same."""
    head = screened_head()
    h = torch.randn(256, 256) * 1.25
    h[::7] *= 0.2  # flatter rows: there a rarer token may win
    seen = []
    decoding = TwoLevelDecoding(head)
    may_win = decoding._rarer_may_win
    decoding._rarer_may_win = lambda flat, margin: seen.append(may_win(flat, margin)) or seen[-1]
    got = decoding.greedy(h)
    assert seen and int((~seen[0]).sum()) > len(seen[0]) // 2, "the screen rules out rows"
    log_p = copy.deepcopy(head).double()(h.double()).detach()
    want = log_p.argmax(-1)
    near = (log_p.gather(1, want[:, None]) - log_p.gather(1, got[:, None]))[:, 0] < 1e-4
    assert bool(((got == want) | near).all())
    assert 0 < int((~torch.isin(got, head.order[:head.shortlist])).sum()) < len(h), "rarer tokens win somewhere"
    alone = torch.cat([decoding.greedy(h[i:i + 1]) for i in range(0, len(h), 16)])
    assert bool(((alone == got[::16]) | near[::16]).all())
