"""Sharded token files: `--shard-tokens` cuts a split into files of at most that many tokens, with counts and
checksums in meta.json; read back as one array, they give the loader exactly the batches one file gives."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from rpt.data.dataset import PreparedData
from rpt.data.prepare import PrepareOptions, prepare
from rpt.data.shards import ShardedTokens
from rpt.data.stream import TokenStream
from rpt.errors import RptError


@pytest.fixture(scope="module")
def both(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("shards")
    whole = prepare(PrepareOptions(out=root / "whole", inputs=[str(small_corpus)], vocab_size=400, progress=False))
    cut = prepare(PrepareOptions(out=root / "cut", inputs=[str(small_corpus)], vocab_size=400, shard_tokens=1500,
                                 progress=False))
    return root, whole, cut


def test_shards_hold_the_tokens_of_one_file_with_their_counts_and_checksums(both):
    root, whole, cut = both
    a, b = PreparedData(root / "whole"), PreparedData(root / "cut")
    for split in ("train", "val"):
        assert "sha256" in whole["splits"][split] and "shards" not in whole["splits"][split]
        assert np.array_equal(np.asarray(b.tokens(split)), np.asarray(a.tokens(split)))
        info = cut["splits"][split]
        if info["tokens"] <= 1500:
            continue
        shards = info["shards"]
        assert len(shards) == -(-info["tokens"] // 1500) and all(s["tokens"] <= 1500 for s in shards)
        assert sum(s["tokens"] for s in shards) == info["tokens"] and sum(s["bytes"] for s in shards) == info["bytes"]
        for s in shards:
            assert hashlib.sha256((root / "cut" / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    assert len(cut["splits"]["train"]["shards"]) > 3 and not (root / "cut" / "train.bin").exists()


def test_sharded_tokens_index_like_one_array(tmp_path):
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 60000, 10_000).astype(np.uint16)
    counts = [3000, 1, 4000, 2999]
    paths = []
    for i, (a, n) in enumerate(zip(np.cumsum([0] + counts[:-1]), counts)):
        paths.append(tmp_path / f"{i:05d}.bin")
        flat[a:a + n].tofile(paths[-1])
    s = ShardedTokens(paths, counts, np.uint16)
    assert len(s) == 10_000 and s.shape == (10_000,)
    idx = rng.integers(0, 10_000, (7, 33))
    assert np.array_equal(s[idx], flat[idx])
    for sl in (slice(0, 10_000), slice(2990, 3010), slice(2999, 3001), slice(-5, None), slice(100, 50), slice(1, 9000, 7)):
        assert np.array_equal(s[sl], flat[sl]), sl
    assert s[3000] == flat[3000] and s[-1] == flat[-1] and np.array_equal(np.asarray(s), flat)
    assert len(s._open) == 4
    fresh = ShardedTokens(paths, counts, np.uint16)
    fresh[np.array([5, 10])]
    assert list(fresh._open) == [0]  # only the shard a read touched is mapped


def test_the_loader_reads_the_same_batches_from_shards_across_their_boundaries(both):
    root, _, _ = both
    a, b = (PreparedData(root / name).tokens("train") for name in ("whole", "cut"))
    for rank in range(2):
        x = TokenStream(a, 3, 16, rank=rank, world_size=2, seed=1)
        y = TokenStream(b, 3, 16, rank=rank, world_size=2, seed=1)
        for _ in range(x.batches_per_epoch + 3):  # past an epoch: the offset windows straddle shard ends
            p, q = next(x), next(y)
            assert torch.equal(p.x, q.x) and torch.equal(p.y, q.y) and torch.equal(p.reset, q.reset)
        assert x.state_dict() == y.state_dict()


def test_a_rank_opens_only_the_shards_its_streams_cross(both):
    root, _, cut = both
    n_shards = len(cut["splits"]["train"]["shards"])
    opened = []
    for rank in range(4):
        tokens = PreparedData(root / "cut").tokens("train")
        stream = TokenStream(tokens, 1, 16, rank=rank, world_size=4, seed=1)
        for _ in range(5):
            next(stream)
        lo, hi = rank * stream.stream_len, rank * stream.stream_len + 6 * 16  # what its one stream has read
        crossed = set(range(int(np.searchsorted(tokens.ends, lo, side="right")),
                            int(np.searchsorted(tokens.ends, hi, side="right")) + 1))
        assert set(tokens._open) <= crossed, (rank, sorted(tokens._open))
        opened.append(set(tokens._open))
    assert n_shards > 4 and all(len(o) < n_shards for o in opened) and opened[0] != opened[3]


def test_a_missing_shard_is_detected_and_a_whole_file_replaces_shards(both, small_corpus):
    root, _, cut = both
    import shutil

    copy = root / "copy"
    shutil.copytree(root / "cut", copy)
    (copy / cut["splits"]["train"]["shards"][1]["file"]).unlink()
    with pytest.raises(RptError, match="incomplete"):
        PreparedData(copy)
    prepare(PrepareOptions(out=copy, inputs=[str(small_corpus)], vocab_size=400, force=True, progress=False))
    assert not (copy / "train").exists() and (copy / "train.bin").is_file()
    PreparedData(copy)
