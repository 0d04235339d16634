"""Byte-level BPE through HF `tokenizers`, and the few facts rpt needs on top of it.

Training, encoding and decoding are the library's. rpt adds: the end-of-document token
(which also starts every document, so the recurrent state can be reset there), the UTF-8
byte length of every token id (so bits per byte is exact on any split of the tokens), and
checks that a tokenizer given by the user is one rpt can use.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rpt.data.sources import EOT
from rpt.errors import RptError

MIN_VOCAB = 257  # 256 byte tokens + the end-of-document token
AUTO_VOCAB = (8192, 32768, 4096)  # the range `--vocab-size auto` chooses in, and its step


def auto_vocab_size(texts: Iterable[str]) -> tuple[int, str]:
    """The vocabulary `--vocab-size auto` gives a corpus, and why: room for every word (a piece of the byte-level
    pre-tokenizer, within which BPE merges) seen at least twice as one token, beside as many pieces that spell it
    and the rarer words (BPE makes a word whole by merging its prefixes): twice the repeated words, rounded up to
    a step of AUTO_VOCAB within its range. Whole words are what a small corpus's model predicts best
    (benchmarks/results/quality.md, issue 44). Reading stops once the largest size is certain."""
    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    low, high, step = AUTO_VOCAB
    counts, repeated = Counter(), 0
    for text in texts:
        for word, _ in split(text):
            counts[word] += 1
            repeated += counts[word] == 2
        if 2 * repeated >= high:
            break
    size = min(high, max(low, -(-2 * repeated // step) * step))
    seen = "at least " if 2 * repeated >= high else ""
    return size, (f"auto: {seen}{repeated:,} of the corpus's distinct words occur twice or more; twice that, in "
                  f"steps of {step:,} from {low:,} to {high:,}")


def train_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Tokenizer:
    if vocab_size < MIN_VOCAB:
        raise RptError(f"vocabulary size {vocab_size} is below {MIN_VOCAB} (256 bytes + end-of-document)",
                       f"use --vocab-size {MIN_VOCAB} or more, e.g. 8192")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise RptError(f"tokenizer file {path} does not exist", "pass a tokenizer.json written by `rpt prepare` or HF tokenizers")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises plain Exception on malformed files
        raise RptError(f"{path} is not a tokenizers JSON file: {exc}", "pass a tokenizer.json saved by HF tokenizers") from None
    if tok.token_to_id(EOT) is None:
        raise RptError(f"tokenizer {path} has no end-of-document token {EOT}",
                       "train one with `rpt prepare` (it adds the token) or add it as a special token")
    token_bytes(tok, where=str(path))  # refuses tokenizers that are not byte-level
    return tok


def eot_id(tok: Tokenizer) -> int:
    return tok.token_to_id(EOT)


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map inverted: the printable character that stands for each byte -> the byte.

    Printable bytes stand for themselves; the other 68 are given the code points from 256 on, in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tok: Tokenizer, where: str = "tokenizer") -> list[bytes]:
    """The UTF-8 bytes each token id stands for; special tokens stand for none."""
    if not isinstance(tok.decoder, decoders.ByteLevel):
        raise RptError(f"{where} is not a byte-level BPE tokenizer (its decoder is {type(tok.decoder).__name__})",
                       "use a byte-level BPE tokenizer, e.g. one trained by `rpt prepare`")
    alphabet = byte_level_alphabet()
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    table = [b""] * tok.get_vocab_size()
    for token, idx in tok.get_vocab().items():
        if token in special:
            continue
        try:
            table[idx] = bytes(alphabet[ch] for ch in token)
        except KeyError:
            raise RptError(f"{where} is not a byte-level BPE tokenizer (token {token!r})",
                           "use a byte-level BPE tokenizer, e.g. one trained by `rpt prepare`") from None
    return table


def token_byte_lengths(tok: Tokenizer, where: str = "tokenizer") -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): exact bits per byte on any split."""
    return np.array([len(b) for b in token_bytes(tok, where)], dtype=np.int32)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
