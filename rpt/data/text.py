"""Text from outside (a request, a command line, a JSON record) that Python holds but UTF-8 cannot write.

`json.loads` turns an escape such as "\\ud83d" without its pair into a lone surrogate, and Python decodes a command
line's undecodable bytes into lone surrogates too; HF tokenizers refuses such a string with a bare TypeError. Every
place such text reaches the tokenizer asks `not_utf8_at` first and refuses (a request, a prompt) or replaces (a
corpus, as it replaces undecodable bytes).
"""

from __future__ import annotations

import re

LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def not_utf8_at(text: str) -> int | None:
    """Where `text` holds a character UTF-8 cannot write (a lone surrogate: a JSON escape such as "\\ud83d" without
    its pair, or a byte a command line could not decode), or None. The tokenizer refuses such a string with a bare
    TypeError, so every place text from outside reaches it asks this first."""
    found = LONE_SURROGATE.search(text)
    return None if found is None else found.start()


def replace_lone_surrogates(text: str) -> tuple[str, int]:
    """`text` with each lone surrogate replaced by U+FFFD, and how many there were."""
    return LONE_SURROGATE.subn("\ufffd", text)


def shown(char: str) -> str:
    """A lone surrogate as a person can read it: the byte a command line could not decode (0xff), else its escape."""
    code = ord(char)
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x} without its pair"
