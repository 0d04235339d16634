"""TokenStream on another layout: the same streams on other ranks continue exactly; a new stream count or
window reads the rest of the epoch once (nothing skipped or read twice), then goes on in its own geometry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rpt.data.stream import TokenStream
from rpt.errors import RptError

N = 10_000
T = 16


def positions(n=N):
    return np.arange(n, dtype=np.uint32)  # token value == position: a batch says where it was read


def layout(world, batch, seq_len=T, **kw):
    return [TokenStream(positions(), batch, seq_len, rank=r, world_size=world, **kw) for r in range(world)]


def read(streams, steps) -> list[int]:
    """Input positions the ranks read over `steps` batches each."""
    got = []
    for s in streams:
        for _ in range(steps):
            got += next(s).x.flatten().tolist()
    return got


def read_epoch(streams, epoch) -> tuple[list[int], list]:
    """Input positions read to the end of `epoch`, and each rank's batches."""
    got, batches = [], []
    for s in streams:
        batches.append([])
        while s.epoch == epoch:
            b = next(s)
            got += b.x.flatten().tolist()
            batches[-1].append(b)
    return got, batches


def resumed(state, world, batch, seq_len=T):
    new = layout(world, batch, seq_len)
    for s in new:
        s.load_state_dict(state)
    return new


def epoch_inputs(world, batch, epoch=0) -> set[int]:
    """Every input position one geometry reads in one whole epoch."""
    return set(read_epoch(layout(world, batch), epoch)[0]) if epoch == 0 else None


def test_the_same_streams_on_other_ranks_continue_exactly():
    old = layout(2, 4)
    read(old, 10)
    whole = TokenStream(positions(), 8, T)  # one rank holding all 8 streams, at the same step
    whole.step = 10
    expected = next(whole)
    for r, s in enumerate(resumed(old[0].state_dict(), 4, 2)):  # 4 ranks x 2 rows: the same 8 streams
        got = next(s)
        assert torch.equal(got.x, expected.x[2 * r:2 * r + 2]) and torch.equal(got.y, expected.y[2 * r:2 * r + 2])


@pytest.mark.parametrize("world, batch, seq_len", [(3, 4, T), (1, 4, T), (2, 4, 8), (4, 5, 24)])
def test_a_new_stream_count_or_window_reads_the_rest_of_the_epoch_once(world, batch, seq_len):
    old = layout(2, 4)
    before = read(old, 10)
    new = resumed(old[0].state_dict(), world, batch, seq_len)
    after, batches = read_epoch(new, 0)
    everything = epoch_inputs(2, 4)
    assert len(set(before)) == len(before) and len(set(after)) == len(after)  # nothing twice within each
    assert not set(before) & set(after)  # nor across the change
    assert set(after) <= everything
    left = everything - set(before) - set(after)
    assert len(left) < world * batch * seq_len  # less than one batch of every new stream, at the epoch's end
    jumped = 0
    for mine in batches:  # each rank's rows laid end to end in time
        x, y, reset = (torch.cat([getattr(b, f) for b in mine], dim=1) for f in ("x", "y", "reset"))
        assert torch.equal(y, x + 1)  # targets are the tokens that follow, across jumps too
        jumps = x[:, 1:] != x[:, :-1] + 1
        assert reset[:, 1:][jumps].all()  # a jump between old streams resets
        jumped += int(jumps.sum())
        assert mine[0].reset[:, 0].all()  # and nothing carries over the change
    assert jumped > 0 or world * batch == 8  # other stream counts: the old streams end inside the new ones
    assert new[0].epoch == 1 and next(new[0]).reset[:, 0].all()


def test_two_changes_in_one_epoch_still_read_each_token_at_most_once():
    old = layout(2, 4)
    first = read(old, 10)
    middle = resumed(old[0].state_dict(), 3, 4)
    second = read(middle, 5)
    last = resumed(middle[0].state_dict(), 1, 4, 8)
    third, _ = read_epoch(last, 0)
    every = first + second + third
    assert len(set(every)) == len(every)
    assert len(epoch_inputs(2, 4) - set(every)) < 4 * 8 + 12 * T


def test_after_the_rest_of_the_epoch_the_new_geometry_goes_on_as_a_fresh_run_would():
    old = layout(2, 4)
    read(old, 10)
    new = resumed(old[0].state_dict(), 3, 4)[1]
    read_epoch([new], 0)
    fresh = TokenStream(positions(), 4, T, rank=1, world_size=3)
    fresh.step = fresh.batches_per_epoch  # the first batch of its second epoch
    a, b = next(new), next(fresh)
    assert torch.equal(a.x, b.x) and torch.equal(a.reset, b.reset)
    state = new.state_dict()  # and a same-layout resume of the resized stream is exact
    again = TokenStream(positions(), 4, T, rank=1, world_size=3)
    again.load_state_dict(state)
    assert all(torch.equal(next(new).x, next(again).x) for _ in range(3))


def test_a_change_at_an_epoch_start_begins_that_epoch_in_the_new_geometry():
    old = layout(2, 4)
    read(old, old[0].batches_per_epoch)
    new = resumed(old[0].state_dict(), 3, 4)[0]
    fresh = TokenStream(positions(), 4, T, rank=0, world_size=3)
    fresh.step = fresh.batches_per_epoch
    assert new.epoch == 1 and torch.equal(next(new).x, next(fresh).x)


def test_random_mode_draws_each_steps_windows_for_every_layout_alike():
    one = TokenStream(positions(), 8, T, mode="random", seed=4)
    one.step = 7
    two = TokenStream(positions(), 4, T, rank=1, world_size=2, mode="random", seed=4)
    two.load_state_dict({**one.state_dict()})
    assert torch.equal(next(two).x, next(one).x[4:])


def test_another_data_or_seed_is_refused():
    s = TokenStream(positions(), 4, T)
    with pytest.raises(RptError, match="seed: saved 0 now 1"):
        TokenStream(positions(), 4, T, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(RptError, match="tokens: saved 10000 now 9000"):
        TokenStream(positions(9000), 4, T).load_state_dict(s.state_dict())
