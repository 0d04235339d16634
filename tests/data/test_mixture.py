"""Mixtures (`data.mix`): rows drawn by weight from sources read each in its own order, the same on any
split of the streams over ranks, resumed exactly; bad mixtures refused; a run reports tokens per source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rpt.config import Config
from rpt.data.mixture import MixedData, MixtureStream
from rpt.data.prepare import PrepareOptions, prepare
from rpt.errors import RptError
from rpt.train.trainer import Trainer


def two_sources():
    """Source 0 holds the values 0..9 (as positions mod 10), source 1 the values 100..109: a token says its source
    and, within a stream, its position."""
    return [np.arange(40_000, dtype=np.int64) % 10, 100 + np.arange(20_000, dtype=np.int64) % 10]


def stream(rank=0, world=1, batch=8, **kw):
    return MixtureStream(["web", "code"], two_sources(), np.array([0.7, 0.3]), batch, 16, rank=rank,
                         world_size=world, seed=3, **kw)


def test_rows_follow_the_weights_and_each_source_is_read_in_order():
    s = stream()
    rows = {0: 0, 1: 0}
    previous = {}  # (stream, source) -> the last token of that stream's last row from it
    for _ in range(400):
        batch = s.__next__()
        for g in range(8):
            row = batch.x[g].numpy()
            j = int(row[0] >= 100)
            assert (row >= 100).all() == bool(j) and (row >= 100).any() == bool(j)  # one source a row
            assert np.array_equal(np.diff(row) % 10, np.ones(15, dtype=np.int64))  # contiguous within it
            if (g, j) in previous:  # the row continues where this stream's last row from source j stopped
                assert (row[0] - previous[(g, j)]) % 10 == 1
            previous[(g, j)] = row[-1]
            rows[j] += 1
    share = rows[0] / (rows[0] + rows[1])
    assert abs(share - 0.7) < 0.03, share
    taken = s.tokens_by_source()
    assert taken["web"] == rows[0] * 16 and taken["code"] == rows[1] * 16


def test_a_row_that_changes_source_resets_and_ranks_read_their_share_of_one_order():
    whole, halves = stream(), [stream(rank=r, world=2, batch=4) for r in range(2)]
    for step in range(30):
        a = next(whole)
        b = [next(h) for h in halves]
        assert np.array_equal(a.x.numpy(), np.concatenate([p.x.numpy() for p in b]))
        assert np.array_equal(a.reset.numpy(), np.concatenate([p.reset.numpy() for p in b]))
        if step:
            changed = whole.draw(step) != whole.draw(step - 1)
            assert np.array_equal(a.reset[:, 0].numpy()[changed], np.ones(changed.sum(), dtype=bool))


def test_a_mixture_resumes_exactly_and_refuses_another_geometry():
    s = stream()
    for _ in range(25):
        next(s)
    state = json.loads(json.dumps(s.state_dict()))
    expected = [next(s) for _ in range(10)]
    t = stream()
    t.load_state_dict(state)
    for want in expected:
        got = next(t)
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, want))
    with pytest.raises(RptError, match="does not fit") as info:
        stream(batch=4).load_state_dict(state)
    assert "world size x batch size" in info.value.fix


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("mix")
    prepare(PrepareOptions(out=root / "a", inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))
    prepare(PrepareOptions(out=root / "b", inputs=[str(small_corpus / "b")], progress=False,
                           tokenizer=str(root / "a" / "tokenizer.json")))
    prepare(PrepareOptions(out=root / "other", inputs=[str(small_corpus / "b")], vocab_size=300, progress=False,
                           val_fraction=0.3))
    return root


def test_bad_mixtures_get_one_clear_message(two_folders):
    with pytest.raises(RptError, match="weight 0") as info:
        Config.load(None, [f'data.mix={{"{two_folders / "a"}" = 1.0, "{two_folders / "b"}" = 0}}'])
    assert "remove" in info.value.fix
    with pytest.raises(RptError, match="another tokenizer") as info:
        MixedData({str(two_folders / "a"): 0.5, str(two_folders / "other"): 0.5})
    assert "--tokenizer" in info.value.fix
    with pytest.raises(RptError, match="not a table"):
        Config.load(None, ["data.mix=0.5"])


def test_a_run_on_a_mixture_reports_the_tokens_of_each_source(two_folders, tmp_path, solo):
    a, b = str(two_folders / "a"), str(two_folders / "b")
    cfg = Config.load(None, [f'data.mix={{"{a}" = 0.75, "{b}" = 0.25}}', "model.d_model=32", "train.batch_size=8",
                             "train.seq_len=16", "train.max_steps=5", "train.warmup_steps=1", "train.eval_interval=0",
                             "train.eval_tokens=1024", "monitor.log_interval=5", "monitor.tensorboard=false"])
    Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    record = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"][-1]
    assert record[f"tokens/{a}"] + record[f"tokens/{b}"] == 5 * 8 * 16 and record[f"tokens/{a}"] > 0
    assert Config.load(tmp_path / "r" / "config.toml").data.mix == {a: 0.75, b: 0.25}
