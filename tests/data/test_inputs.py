"""Input kinds of `rpt prepare` beyond text, jsonl and gzip: parquet (row groups streamed, nulls counted) and
zstandard (.zst, .jsonl.zst, several frames); each round-trips to a re-encoding of its documents, and a damaged
one is one clear error that leaves nothing behind."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from rpt.data.dataset import PreparedData
from rpt.data.prepare import PrepareOptions, prepare
from rpt.errors import RptError


def expected_tokens(data: PreparedData, texts: list[str], val_fraction: float) -> dict:
    """Each document's tokens after the end-of-document token, in order, on the side its hash puts it."""
    out = {"train": [], "val": []}
    for text in texts:
        h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        out["val" if h / 2.0**64 < val_fraction else "train"] += [data.eot_id] + data.tokenizer.encode(
            text, add_special_tokens=False).ids
    return out


def assert_round_trip(out, texts, val_fraction=0.2):
    data = PreparedData(out)
    if data.meta["split_rule"]["kind"] == "tail":  # too few documents to split by: the text's last share is val
        got = np.concatenate([data.tokens("train"), data.tokens("val")])
        every = [t for text in texts for t in [data.eot_id] + data.tokenizer.encode(text, add_special_tokens=False).ids]
        assert np.array_equal(got, np.array(every))
        return
    expected = expected_tokens(data, texts, val_fraction)
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(data.tokens(split)), np.array(expected[split])), split


def test_parquet_streams_its_row_groups_and_counts_null_texts(tmp_path, shakespeare_text):
    texts = [shakespeare_text[i * 2500:(i + 1) * 2500] for i in range(40)]
    column = texts[:17] + [None] + texts[17:]
    table = pa.table({"id": list(range(len(column))), "body": column})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=6)  # 7 row groups
    assert pq.ParquetFile(tmp_path / "part.parquet").num_row_groups == 7
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "part.parquet")], vocab_size=400,
                                  text_field="body", val_fraction=0.2, progress=False))
    assert meta["report"]["documents"] == 40 and meta["report"]["missing_field_lines"] == 1
    assert_round_trip(tmp_path / "o", texts)


def test_zstd_text_and_jsonl_of_several_frames_round_trip(tmp_path, shakespeare_text):
    texts = [shakespeare_text[i * 3000:(i + 1) * 3000] for i in range(20)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[:12]).encode()
    cut = len(lines) // 2
    frames = zstandard.ZstdCompressor().compress(lines[:cut]) + zstandard.ZstdCompressor().compress(lines[cut:])
    (tmp_path / "a.jsonl.zst").write_bytes(frames)  # two frames back to back, as pzstd writes them
    (tmp_path / "b.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(texts[12:]).encode()))
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "a.jsonl.zst"), str(tmp_path / "b.zst")],
                                  vocab_size=400, val_fraction=0.2, progress=False))
    assert meta["report"]["documents"] == 13  # twelve records and one text file
    assert_round_trip(tmp_path / "o", texts[:12] + ["".join(texts[12:])])


def test_a_dataset_saved_by_hugging_face_datasets_is_read_shard_by_shard(tmp_path, shakespeare_text):
    datasets = pytest.importorskip("datasets")
    texts = [shakespeare_text[i * 2000:(i + 1) * 2000] for i in range(60)]
    ds = datasets.Dataset.from_dict({"text": texts[:30] + [None] + texts[30:], "n": list(range(61))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "saved")], vocab_size=400,
                                  val_fraction=0.2, progress=False))
    assert meta["report"]["documents"] == 60 and meta["report"]["missing_field_lines"] == 1
    assert_round_trip(tmp_path / "o", texts)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "both"))
    with pytest.raises(RptError) as info:
        prepare(PrepareOptions(out=tmp_path / "o2", inputs=[str(tmp_path / "both")], vocab_size=400, progress=False))
    assert "DatasetDict" in info.value.message and "both/train" in info.value.fix
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("kind", ["cut zst", "not zst", "parquet without the field", "not parquet"])
def test_a_damaged_input_is_one_clear_error_and_leaves_nothing(tmp_path, shakespeare_text, kind):
    whole = zstandard.ZstdCompressor().compress(("".join(json.dumps({"text": shakespeare_text[i:i + 500]}) + "\n"
                                                          for i in range(0, 200_000, 500))).encode())
    if kind == "cut zst":
        path, fix, message = tmp_path / "c.jsonl.zst", "re-create", "cut short"
        path.write_bytes(whole[:len(whole) // 2])
    elif kind == "not zst":
        path, fix, message = tmp_path / "c.jsonl.zst", "re-create", "not valid zstd"
        path.write_bytes(b"this is plain text, not zstd" * 100)
    elif kind == "parquet without the field":
        path, fix, message = tmp_path / "c.parquet", "--text-field content", "no column 'text'"
        pq.write_table(pa.table({"content": ["a", "b"], "id": [1, 2]}), path)
    else:
        path, fix, message = tmp_path / "c.parquet", "re-create", "as parquet"
        path.write_bytes(b"PAR1 and then nothing")
    out = tmp_path / "o"
    with pytest.raises(RptError) as info:
        prepare(PrepareOptions(out=out, inputs=[str(path)], vocab_size=300, progress=False))
    assert message in info.value.message and fix in info.value.fix
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_exact_duplicates_are_dropped_and_long_documents_cut_and_both_counted(tmp_path, shakespeare_text):
    texts = [shakespeare_text[i * 3000:(i + 1) * 3000] for i in range(30)]
    records = texts + [texts[3], texts[7], texts[3]]  # three copies of earlier documents
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    meta = prepare(PrepareOptions(out=tmp_path / "d", inputs=[str(tmp_path / "c.jsonl")], vocab_size=400,
                                  dedup=True, progress=False))
    r = meta["report"]
    assert (r["duplicate_documents"], r["documents"]) == (3, 30)
    data = PreparedData(tmp_path / "d")
    per_doc = [1 + len(data.tokenizer.encode(t, add_special_tokens=False).ids) for t in (texts[3], texts[7], texts[3])]
    assert r["duplicate_tokens"] == sum(per_doc)
    assert_round_trip(tmp_path / "d", texts, val_fraction=0.1)
    cap = 1000
    meta = prepare(PrepareOptions(out=tmp_path / "cap", inputs=[str(tmp_path / "c.jsonl")], vocab_size=400,
                                  max_doc_chars=cap, progress=False))
    assert meta["report"]["truncated_documents"] == 33
    assert meta["report"]["truncated_chars"] == sum(len(t) - cap for t in records)
    assert_round_trip(tmp_path / "cap", [t[:cap] for t in records], val_fraction=0.1)
