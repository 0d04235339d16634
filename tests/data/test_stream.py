"""TokenStream: rows continue across batches, ranks are disjoint, resume is exact, resets are marked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rpt.data.stream import TokenStream
from rpt.errors import RptError

N = 10_000


def positions(n=N):
    # Token value == position (fits uint32), so every batch tells where it was read from.
    return np.arange(n, dtype=np.uint32)


def take(stream, n):
    return [next(stream) for _ in range(n)]


def test_rows_continue_batch_to_batch_and_targets_are_shifted():
    s = TokenStream(positions(), batch_size=4, seq_len=16)
    batches = take(s, s.batches_per_epoch)
    for b in batches:
        assert torch.equal(b.y[:, :-1], b.x[:, 1:])
        assert torch.equal(b.y[:, -1], b.x[:, -1] + 1)
    for prev, nxt in zip(batches, batches[1:]):
        assert torch.equal(nxt.x[:, 0], prev.y[:, -1])  # row b continues row b


def test_ranks_read_disjoint_tokens():
    world, seen = 3, []
    for rank in range(world):
        s = TokenStream(positions(), batch_size=2, seq_len=8, rank=rank, world_size=world)
        toks = torch.cat([torch.cat([b.x, b.y], 1).flatten() for b in take(s, 2 * s.batches_per_epoch)])
        seen.append(set(toks.tolist()))
    for i in range(world):
        for j in range(i + 1, world):
            assert not seen[i] & seen[j]


def test_deterministic_for_a_seed_and_epochs_shift():
    a = TokenStream(positions(), 4, 16, seed=1)
    b = TokenStream(positions(), 4, 16, seed=1)
    c = TokenStream(positions(), 4, 16, seed=2)
    steps = 4 * a.batches_per_epoch
    xa, xb, xc = (torch.stack([bt.x for bt in take(s, steps)]) for s in (a, b, c))
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc)
    per = a.batches_per_epoch
    offsets = {int(xa[e * per, 0, 0]) for e in range(4)}
    assert len(offsets) > 1  # later epochs cut the windows elsewhere


@pytest.mark.parametrize("mode", ["stream", "random"])
def test_exact_resume(mode):
    s = TokenStream(positions(), 4, 16, seed=3, mode=mode)
    take(s, s.batches_per_epoch + 3)  # past an epoch boundary
    state = s.state_dict()
    expected = take(s, 5)
    r = TokenStream(positions(), 4, 16, seed=3, mode=mode)
    r.load_state_dict(state)
    for e, got in zip(expected, take(r, 5)):
        assert torch.equal(e.x, got.x) and torch.equal(e.y, got.y) and torch.equal(e.reset, got.reset)


def test_resume_refuses_another_seed():
    s = TokenStream(positions(), 4, 16)
    other = TokenStream(positions(), 4, 16, seed=5)
    with pytest.raises(RptError, match="seed: saved 0 now 5"):
        other.load_state_dict(s.state_dict())


def test_reset_mask_marks_document_starts_and_epoch_starts():
    tokens = (positions() % 97).astype(np.uint16)  # a document starts (token 0) every 97 positions
    s = TokenStream(tokens, 4, 16, eot_id=0)
    first, second = take(s, 2)
    expected_first = first.x == 0
    expected_first[:, 0] = True  # nothing carries into the first batch of an epoch
    assert torch.equal(first.reset, expected_first)
    assert torch.equal(second.reset, second.x == 0)
    assert second.reset.any() and not second.reset.all()
    s.step = s.batches_per_epoch  # first batch of the second epoch
    assert next(s).reset[:, 0].all()


def test_random_mode_draws_windows_from_the_data():
    s = TokenStream(positions(), 4, 16, seed=0, mode="random", rank=1, world_size=2)
    b = next(s)
    assert torch.equal(b.x[:, 1:], b.x[:, :-1] + 1) and b.reset[:, 0].all()
    assert not torch.equal(b.x, TokenStream(positions(), 4, 16, seed=0, mode="random").batch(0).x)


def test_too_little_data_is_a_clear_error():
    with pytest.raises(RptError, match="too few"):
        TokenStream(positions(100), batch_size=8, seq_len=16)
