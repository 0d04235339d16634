"""Byte-level BPE: exact round trips on real text, byte lengths, and refusing unusable tokenizers."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from rpt.data.tokenizer import eot_id, load_tokenizer, token_byte_lengths, train_tokenizer
from rpt.errors import RptError

EXTRA = "naïve café — ΑΒΓ δ 漢字かな 🙂\t\r\n  trailing   \n"


@pytest.fixture(scope="module")
def tok(shakespeare_text):
    return train_tokenizer([shakespeare_text[:200_000], EXTRA], vocab_size=500)


def test_round_trip_on_real_text(tok, shakespeare_text):
    for text in (shakespeare_text[200_000:260_000], EXTRA, "x\ufffdy", ""):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text


def test_undecodable_bytes_round_trip_as_replacement(tok):
    raw = b"ok \xff\xfe then \xc3( end"
    text = raw.decode("utf-8", errors="replace")
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_token_byte_lengths_sum_to_utf8_length(tok, shakespeare_text):
    lengths = token_byte_lengths(tok)
    assert lengths[eot_id(tok)] == 0
    for text in (shakespeare_text[300_000:310_000], EXTRA):
        ids = np.array(tok.encode(text, add_special_tokens=False).ids)
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_load_refuses_unusable_tokenizers(tmp_path, tok):
    with pytest.raises(RptError, match="does not exist"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RptError, match="not a tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["some text without the marker"] * 10,
                              trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    plain.save(str(tmp_path / "noeot.json"))
    with pytest.raises(RptError, match="no end-of-document"):
        load_tokenizer(tmp_path / "noeot.json")
    wordlevel = Tokenizer(models.WordLevel({"hello world": 0, "<|endoftext|>": 1}, unk_token="hello world"))
    wordlevel.save(str(tmp_path / "wordlevel.json"))
    with pytest.raises(RptError, match="not a byte-level BPE"):
        load_tokenizer(tmp_path / "wordlevel.json")
    tok.save(str(tmp_path / "good.json"))
    assert load_tokenizer(tmp_path / "good.json").get_vocab_size() == tok.get_vocab_size()


def test_token_bytes_decode_like_the_tokenizer(tok, shakespeare_text):
    from rpt.data.tokenizer import token_bytes

    table = token_bytes(tok)
    for text in (shakespeare_text[400_000:405_000], EXTRA):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert b"".join(table[i] for i in ids).decode("utf-8") == text
