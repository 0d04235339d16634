"""benchmarks/quality/peers.py turns each peer's loss into bits per byte with that peer's own token count: checked on
tiny texts where the answer is known."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("peers", Path(__file__).resolve().parents[1] / "benchmarks" / "quality" / "peers.py")
peers = importlib.util.module_from_spec(SPEC)
sys.modules['peers'] = peers  # its dataclasses look themselves up there
SPEC.loader.exec_module(peers)


def test_a_uniform_character_model_scores_log2_of_its_vocabulary_per_ascii_byte():
    text = "abcd" * 25  # a model uniform over 4 characters: ln 4 nats per character, one byte each
    assert peers.bits_per_byte(math.log(4), peers.char_tokens(text), len(text.encode())) == pytest.approx(2.0)


def test_characters_of_several_bytes_lower_the_bits_per_byte():
    text = "éa" * 10  # 20 characters, 30 bytes; uniform over 2 characters: 1 bit a character
    assert peers.char_tokens(text) == 20
    assert peers.bits_per_byte(math.log(2), peers.char_tokens(text), len(text.encode())) == pytest.approx(20 / 30)


def test_word_tokens_count_words_and_one_eos_per_line_as_word_language_model_reads_them(tmp_path):
    path = tmp_path / "test.txt"
    path.write_bytes(b"to be  or\r\nnot\n\nto be")  # 3 + 1 + 0 + 2 words, 4 lines (the last without newline)
    assert peers.word_tokens(path) == 6 + 4
    # uniform over 8 word types: 3 bits a token, 10 tokens over 21 bytes
    assert peers.bits_per_byte(math.log(8), peers.word_tokens(path), 21) == pytest.approx(30 / 21)


def test_the_peers_printed_losses_are_read_back():
    nanogpt = "step 0: train loss 4.2000, val loss 4.1000\nstep 250: train loss 2.1, val loss 2.3000\n" \
              "step 500: train loss 1.9, val loss 2.3500\n"
    assert peers.nanogpt_best_val(nanogpt) == pytest.approx(2.3)
    wlm = "| End of training | test loss  5.30 | test ppl   200.34\n"
    assert peers.wlm_test_loss(wlm) == pytest.approx(math.log(200.34))
    with pytest.raises(RuntimeError, match="no test loss"):
        peers.wlm_test_loss("| end of epoch   1 | time: 3.00s |")


def test_the_gpt_peers_sliding_windows_score_every_held_out_token_once(tmp_path):
    """SCORE_GPT runs in nanoGPT's folder against its model.py: here a stand-in whose loss is the targets' own
    mean value (ignoring -1), so the sum it reports is the sum of every scored target, each once."""
    import subprocess

    import numpy as np

    (tmp_path / "model.py").write_text(
        "import torch\n"
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class GPTConfig:\n    block_size: int = 8\n"
        "class GPT(torch.nn.Module):\n"
        "    def __init__(self, config):\n        super().__init__(); self.config = config\n"
        "    def forward(self, x, y):\n"
        "        kept = y[y >= 0].double()\n        return None, kept.mean()\n")
    import torch
    torch.save({"model_args": {"block_size": 8}, "model": {}}, tmp_path / "ckpt.pt")
    for n in (50, 57, 9):  # windows at a stride of 4 that end exactly, overhang, or one window alone
        val = np.arange(n, dtype=np.uint16)
        val.tofile(tmp_path / "val.bin")
        done = subprocess.run([sys.executable, "-c", peers.SCORE_GPT, "ckpt.pt", "val.bin"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        tokens, total = done.stdout.split("scored ")[1].split(" tokens, nats ")
        assert int(tokens) == n - 1 and float(total) == pytest.approx(sum(range(1, n)))


def test_the_prose_corpus_keeps_the_prose_of_restructured_text():
    rst = (".. _label:\n\n*****\nTitle\n*****\n\nUse :func:`len` or :meth:`~dict.get` and ``x + 1``, see `the docs "
           "<https://x>`_. For example::\n\n   >>> len([])\n   0\n\n.. note::\n\n   Indented note.\n\nAfter.\n")
    assert peers.rst_prose(rst) == "Title\n\nUse len or get and x + 1, see the docs. For example:\n\nAfter.\n"
