"""`rpt prepare` over many workers and parts: the units are a function of the inputs, so `--workers 2`, `--part`
runs in any order and a prepare resumed after an interruption write the dataset one plain run writes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rpt.data.units as units_mod
import rpt.data.workers as workers_mod
from rpt.cli import format_prepare_report
from rpt.data.dataset import PreparedData
from rpt.data.prepare import PrepareOptions, prepare
from rpt.errors import RptError
from tests.data.test_inputs import assert_round_trip


@pytest.fixture
def corpus(tmp_path, shakespeare_text, monkeypatch):
    """Two jsonl files and a parquet file of nine row groups, cut into units of about 40 KB (seven units)."""
    monkeypatch.setattr(units_mod, "UNIT_BYTES", 40_000)
    texts = [shakespeare_text[i * 1500:(i + 1) * 1500] for i in range(120)]
    root = tmp_path / "in"
    root.mkdir()
    for k in range(2):
        (root / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[k * 30:(k + 1) * 30]))
    pq.write_table(pa.table({"text": texts[60:] + texts[:5]}), root / "z.parquet", row_group_size=8,
                   compression="none")
    return root, texts[:60] + texts[60:] + texts[:5]


def opts(out, root, **kw) -> PrepareOptions:
    return PrepareOptions(out=out, inputs=[str(root)], vocab_size=320, val_fraction=0.2, progress=False, **kw)


def files(out) -> dict:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.bin"))}


def test_workers_and_parts_in_any_order_write_what_one_run_writes(tmp_path, corpus):
    root, texts = corpus
    one = prepare(opts(tmp_path / "one", root, shard_tokens=20_000, dedup=True))
    assert one["units"] >= 5 and one["report"]["duplicate_documents"] == 5
    assert_round_trip(tmp_path / "one", texts[:120], val_fraction=0.2)
    assert len(one["splits"]["train"]["shards"]) > 2
    two = prepare(opts(tmp_path / "two", root, shard_tokens=20_000, dedup=True, workers=2))
    assert files(tmp_path / "two") == files(tmp_path / "one") and two["splits"] == one["splits"]
    out = tmp_path / "parts"
    for i in (2, 0):
        status = prepare(opts(out, root, shard_tokens=20_000, dedup=True, part=(i, 3)))
        assert 0 < status["units_done"] < status["units"] and not (out / "meta.json").exists()
        assert f"part {i}/3 of {out} is prepared" in format_prepare_report(status, out)
    with pytest.raises(RptError, match="not prepared yet") as info:
        prepare(PrepareOptions(out=out, merge=True, progress=False))
    assert "--part" in info.value.fix
    last = prepare(opts(out, root, shard_tokens=20_000, dedup=True, part=(1, 3)))  # the last part writes it
    assert files(out) == files(tmp_path / "one") and last["splits"] == one["splits"]
    assert not (tmp_path / ".parts.work").exists()
    assert prepare(PrepareOptions(out=out, merge=True, progress=False))["reused"]  # merged already
    PreparedData(out)


def test_an_interrupted_prepare_resumes_with_the_units_it_finished(tmp_path, corpus, monkeypatch):
    root, _ = corpus
    clean = prepare(opts(tmp_path / "clean", root))
    encoded, real = [], workers_mod.encode_unit

    def stop_after_three(job, unit, tok, progress=None):
        if len(encoded) == 3:
            raise KeyboardInterrupt  # as ctrl-C in the middle of the fourth unit
        encoded.append(unit.index)
        return real(job, unit, tok, progress)

    monkeypatch.setattr(workers_mod, "encode_unit", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(opts(tmp_path / "o", root))
    assert sorted(p.name for p in (tmp_path / ".o.work" / "units").glob("*.json")) == \
        [f"{i:05d}.json" for i in encoded]
    assert not (tmp_path / "o").exists()
    again = []
    monkeypatch.setattr(workers_mod, "encode_unit", lambda job, unit, tok, progress=None:
                        again.append(unit.index) or real(job, unit, tok, progress))
    resumed = prepare(opts(tmp_path / "o", root))
    assert sorted(again) == sorted(set(range(clean["units"])) - set(encoded))  # only what was not finished
    assert files(tmp_path / "o") == files(tmp_path / "clean") and resumed["splits"] == clean["splits"]


def test_part_and_work_folder_mistakes_are_clear(tmp_path, corpus, shakespeare_text):
    root, _ = corpus
    with pytest.raises(RptError, match="not a part of 3") as info:
        prepare(opts(tmp_path / "o", root, part=(3, 3)))
    assert "--part 2/3" in info.value.fix
    with pytest.raises(RptError, match="no prepare of"):
        prepare(PrepareOptions(out=tmp_path / "o", merge=True, progress=False))
    prepare(opts(tmp_path / "o", root, part=(0, 2)))
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text(shakespeare_text[:50_000])
    with pytest.raises(RptError, match="unfinished prepare of other inputs") as info:
        prepare(opts(tmp_path / "o", other, part=(1, 2)))
    assert "--force" in info.value.fix
    assert prepare(opts(tmp_path / "o", other, force=True))["split_rule"]["kind"] == "tail"
    assert not (tmp_path / ".o.work").exists()


def test_a_bad_input_met_by_a_worker_is_one_clear_error_and_leaves_nothing(tmp_path, corpus):
    root, _ = corpus
    prepare(opts(tmp_path / "tok", root))
    pq.write_table(pa.table({"content": ["x" * 100] * 10}), root / "y.parquet")  # sorted between the others
    with pytest.raises(RptError, match="no column 'text'") as info:  # met in a worker: no tokenizer to train
        prepare(opts(tmp_path / "o", root, workers=2, tokenizer=str(tmp_path / "tok" / "tokenizer.json")))
    assert "--text-field content" in info.value.fix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "tok"]
