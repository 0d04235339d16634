"""`rpt prepare`: shards equal a re-encoding, split rules, inputs of every kind, and bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rpt.data import prepare as prepare_mod
from rpt.data import sources as sources_mod
from rpt.data.dataset import PreparedData
from rpt.data.prepare import PrepareOptions, prepare
from rpt.data.sources import EOT
from rpt.data.tokenizer import token_byte_lengths
from rpt.errors import RptError


def _docs_in_order(root: Path) -> list[str]:
    files = sorted(root.rglob("*.txt"), key=lambda p: (str(p.parent), p.name))
    return [p.read_bytes().decode("utf-8", errors="replace") for p in files]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("prep") / "ds"
    mp = pytest.MonkeyPatch()
    mp.setattr(sources_mod, "PIECE_CHARS", 3000)  # many cuts inside each document
    try:
        meta = prepare(PrepareOptions(out=out, inputs=[str(small_corpus)], vocab_size=600, val_fraction=0.2,
                                      progress=False))
    finally:
        mp.undo()
    return out, meta


def test_shards_equal_a_reencoding_of_each_document(prepared, small_corpus):
    out, meta = prepared
    data = PreparedData(out)
    tok = data.tokenizer
    eot = data.eot_id
    expected = {"train": [], "val": []}
    for text in _docs_in_order(small_corpus):
        h = int.from_bytes(__import__("hashlib").blake2b(text.encode(), digest_size=8).digest(), "little")
        side = "val" if h / 2.0**64 < 0.2 else "train"
        expected[side].extend([eot] + tok.encode(text, add_special_tokens=False).ids)
    assert meta["split_rule"]["kind"] == "hash"
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(data.tokens(split)), np.array(expected[split])), split
    assert meta["splits"]["val"]["documents"] > 0 and meta["splits"]["train"]["documents"] > 0


def test_byte_counts_are_exact_and_decode_round_trips(prepared, small_corpus):
    out, meta = prepared
    data = PreparedData(out)
    lengths = token_byte_lengths(data.tokenizer)
    total_text = "".join(_docs_in_order(small_corpus))
    assert meta["report"]["text_bytes"] == len(total_text.encode("utf-8"))
    assert sum(meta["splits"][s]["bytes"] for s in ("train", "val")) == len(total_text.encode("utf-8"))
    for split in ("train", "val"):
        ids = np.asarray(data.tokens(split))
        text = data.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        assert len(text.encode("utf-8")) == meta["splits"][split]["bytes"] == int(lengths[ids].sum())


def test_undecodable_bytes_are_replaced_and_counted(prepared, small_corpus):
    _, meta = prepared
    broken_files = len([i for i in range(60) if i % 11 == 0])
    assert meta["report"]["replaced_sequences"] == 3 * broken_files  # \xff, \xfe and a truncated \xc3 per file


def test_split_is_deterministic_and_independent_of_input_order(tmp_path, small_corpus):
    a, b = small_corpus / "a", small_corpus / "b"
    m1 = prepare(PrepareOptions(out=tmp_path / "1", inputs=[str(a), str(b)], vocab_size=300, val_fraction=0.2, progress=False))
    m2 = prepare(PrepareOptions(out=tmp_path / "2", inputs=[str(b), str(a)], vocab_size=300, val_fraction=0.2, progress=False))
    assert m1["split_rule"]["kind"] == m2["split_rule"]["kind"] == "hash"
    for split in ("train", "val"):
        assert m1["splits"][split]["bytes"] == m2["splits"][split]["bytes"]
        assert m1["splits"][split]["documents"] == m2["splits"][split]["documents"]


def test_single_file_falls_back_to_contiguous_tail(tmp_path, shakespeare, shakespeare_text):
    meta = prepare(PrepareOptions(out=tmp_path / "s", inputs=[str(shakespeare)], vocab_size=400, progress=False))
    assert meta["split_rule"]["kind"] == "tail"
    data = PreparedData(tmp_path / "s")
    val_text = data.tokenizer.decode(np.asarray(data.tokens("val")).tolist(), skip_special_tokens=True)
    train_text = data.tokenizer.decode(np.asarray(data.tokens("train")).tolist(), skip_special_tokens=True)
    assert train_text + val_text == shakespeare_text
    n = len(shakespeare_text.encode())
    assert 0.9 * n <= len(train_text.encode()) < 0.9 * n + 50  # nanoGPT's split, to the next token boundary


def test_jsonl_gzip_and_document_markers(tmp_path, shakespeare_text):
    records = [{"text": shakespeare_text[i * 3000:(i + 1) * 3000]} for i in range(30)]
    lines = [json.dumps(r) for r in records] + ["not json", json.dumps({"other": "x"})]
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    (tmp_path / "marked.txt").write_text(f"first doc{EOT}second doc{EOT}third doc")
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "*.gz"), str(tmp_path / "marked.txt")],
                                  vocab_size=300, progress=False))
    assert meta["report"]["documents"] == 30 + 3
    assert meta["report"]["bad_jsonl_lines"] == 1 and meta["report"]["missing_field_lines"] == 1
    assert meta["report"]["fields_seen"] == ["other"]
    data = PreparedData(tmp_path / "o")
    all_ids = np.concatenate([data.tokens("train"), data.tokens("val")])
    assert int((all_ids == data.eot_id).sum()) == 33
    assert EOT not in data.tokenizer.decode(all_ids.tolist(), skip_special_tokens=True)


def test_reuses_the_same_dataset_and_a_given_tokenizer(tmp_path, small_corpus, prepared):
    out, meta = prepared
    again = prepare(PrepareOptions(out=tmp_path / "t", inputs=[str(small_corpus)], tokenizer=str(out / "tokenizer.json"),
                                   val_fraction=0.2, progress=False))
    assert again["tokenizer_sha256"] == meta["tokenizer_sha256"]
    assert again["splits"] == meta["splits"]
    reused = prepare(PrepareOptions(out=tmp_path / "t", inputs=[str(small_corpus)], tokenizer=str(out / "tokenizer.json"),
                                    val_fraction=0.2, progress=False))
    assert reused.get("reused") is True


# ---------------------------------------------------------------------------- bad input

def _no_leftovers(parent: Path) -> bool:
    return not any(".partial-" in p.name or p.name.endswith(".work") for p in parent.iterdir())


def test_missing_input_path(tmp_path):
    with pytest.raises(RptError, match="does not exist"):
        prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "nope.txt")], progress=False))
    assert not (tmp_path / "o").exists()


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(RptError, match="matches no file"):
        prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "*.txt")], progress=False))


def test_empty_corpus(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    (tmp_path / "in" / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(RptError, match="holds no text"):
        prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "in")], progress=False))
    assert not (tmp_path / "o").exists() and _no_leftovers(tmp_path)


def test_vocabulary_too_large_for_dtype(tmp_path, small_corpus):
    with pytest.raises(RptError, match="does not fit uint16"):
        prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(small_corpus)], vocab_size=70000, dtype="uint16",
                               progress=False))
    assert not (tmp_path / "o").exists()


def test_vocabulary_too_small(tmp_path, small_corpus):
    with pytest.raises(RptError, match="below 257"):
        prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(small_corpus)], vocab_size=100, progress=False))


def test_refuses_a_different_dataset_unless_forced(tmp_path, small_corpus):
    out = tmp_path / "o"
    prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))
    before = (out / "meta.json").read_text()
    with pytest.raises(RptError, match="different dataset"):
        prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "b")], vocab_size=300, progress=False))
    assert (out / "meta.json").read_text() == before
    meta = prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "b")], vocab_size=300, force=True, progress=False))
    assert json.loads((out / "meta.json").read_text())["fingerprint"] == meta["fingerprint"] != json.loads(before)["fingerprint"]


def test_a_folder_prepared_under_an_older_fingerprint_says_so(tmp_path, small_corpus):
    out = tmp_path / "o"
    opts = PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False)
    assert not prepare(opts).get("reused")
    assert prepare(opts)["reused"]  # the same inputs again: reused
    meta = json.loads((out / "meta.json").read_text())
    del meta["fingerprint_scheme"]  # as rpt wrote it before the scheme was recorded
    meta["fingerprint"] = "0" * 64
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RptError, match="another version of rpt") as err:
        prepare(opts)
    assert "--force" in err.value.fix
    assert prepare(PrepareOptions(**{**opts.__dict__, "force": True}))["fingerprint_scheme"] == 2


def test_a_failure_midway_leaves_the_previous_dataset_intact(tmp_path, small_corpus, monkeypatch):
    out = tmp_path / "o"
    prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise RptError("disk full (simulated)")

    monkeypatch.setattr(prepare_mod, "write_splits", boom)
    with pytest.raises(RptError, match="simulated"):
        prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "b")], vocab_size=300, force=True, progress=False))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _no_leftovers(tmp_path)
    PreparedData(out)


def test_incomplete_dataset_is_detected(tmp_path, small_corpus):
    out = tmp_path / "o"
    prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))
    with open(out / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(RptError, match="incomplete"):
        PreparedData(out)
    meta = json.loads((out / "meta.json").read_text())
    del meta["splits"]["val"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RptError, match="damaged .*no split val"):
        PreparedData(out)
    (out / "meta.json").unlink()
    with pytest.raises(RptError, match="no meta.json"):
        prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))


def test_cli_prints_one_clear_message_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rpt", "prepare", "--input", str(tmp_path / "missing"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    debug = subprocess.run([sys.executable, "-m", "rpt", "--debug", "prepare", "--input", str(tmp_path / "missing"),
                            "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert "Traceback" in debug.stderr


def test_cli_prepares_and_reports(tmp_path, small_corpus):
    proc = subprocess.run([sys.executable, "-m", "rpt", "prepare", "--input", str(small_corpus), "--out",
                           str(tmp_path / "o"), "--vocab-size", "300"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prepared" in proc.stdout and "train" in proc.stdout and "undecodable" in proc.stdout
    PreparedData(tmp_path / "o")


def test_the_same_text_copied_or_touched_is_the_same_dataset(tmp_path, small_corpus):
    """The fingerprint follows the content, not the file's path or timestamps (a fresh checkout keeps its data)."""
    import os
    import shutil

    out, copy = tmp_path / "o", tmp_path / "copy"
    shutil.copytree(small_corpus / "a", copy)
    prepare(PrepareOptions(out=out, inputs=[str(small_corpus / "a")], vocab_size=300, progress=False))
    for f in copy.rglob("*"):
        if f.is_file():
            os.utime(f, (1, 1))
    assert prepare(PrepareOptions(out=out, inputs=[str(copy)], vocab_size=300, progress=False)).get("reused") is True
    edited = next(f for f in copy.rglob("*") if f.is_file())
    edited.write_text(edited.read_text() + "one more line\n")
    with pytest.raises(RptError, match="different dataset"):
        prepare(PrepareOptions(out=out, inputs=[str(copy)], vocab_size=300, progress=False))


def _word(i: int) -> str:
    """The i-th of distinct all-letter words (one pre-tokenizer piece each, with its leading space)."""
    letters = ""
    while True:
        letters, i = letters + "abcdefghijklmnopqrstuvwxyz"[i % 26], i // 26
        if not i:
            return " " + letters


def test_auto_vocabulary_is_twice_the_repeated_words_in_steps_within_its_range():
    from rpt.data.tokenizer import auto_vocab_size

    twice, once = [_word(i) for i in range(5000)], [_word(i) for i in range(5000, 8000)]
    assert auto_vocab_size(["".join(twice * 2 + once)])[0] == 12288  # 2 x 5000, up to a step of 4096
    assert auto_vocab_size(["".join(twice[:100] * 3)])[0] == 8192  # a small corpus: the floor
    read = []

    def many():  # 40,000 repeated words, a document of 1,000 at a time: reading stops once the cap is certain
        for d in range(40):
            read.append(d)
            yield "".join([_word(i) for i in range(d * 1000, (d + 1) * 1000)] * 2)

    size, why = auto_vocab_size(many())
    assert size == 32768 and len(read) == 17 and why.startswith("auto: at least 17,000")


def test_prepare_defaults_to_the_auto_vocabulary_and_says_why(tmp_path, small_corpus):
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(small_corpus)], progress=False))
    assert meta["vocab_choice"].startswith("auto: ") and 257 <= meta["vocab_size"] <= 8192
    with pytest.raises(RptError, match="neither a number nor auto"):
        prepare(PrepareOptions(out=tmp_path / "p", inputs=[str(small_corpus)], vocab_size="big", progress=False))


def test_a_jsonl_escape_without_its_surrogate_pair_is_replaced_and_counted_not_a_crash(tmp_path, shakespeare_text):
    records = [json.dumps({"text": shakespeare_text[i * 2000:(i + 1) * 2000]}) for i in range(20)]
    records[3] = '{"text": "a lone half \\ud83d here, a pair \\ud83d\\ude42 there"}'
    (tmp_path / "c.jsonl").write_text("\n".join(records) + "\n")
    meta = prepare(PrepareOptions(out=tmp_path / "o", inputs=[str(tmp_path / "c.jsonl")], vocab_size=300,
                                  progress=False))
    assert meta["report"]["documents"] == 20 and meta["report"]["replaced_sequences"] == 1
    data = PreparedData(tmp_path / "o")
    text = data.tokenizer.decode(np.concatenate([data.tokens("train"), data.tokens("val")]).tolist())
    assert "a lone half \ufffd here, a pair \U0001f642 there" in text
