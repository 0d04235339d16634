"""The serving engine: many streams generated as one batch, each holding one fixed-size recurrent state.

    an admitted stream -> its prompt through the sequence form, `prefill_chunk` tokens per engine step
                       -> its first token sampled, its state joins the running batch (rows of one state tree)
    every step:   one token for every running row (model.step), each row sampled with its own settings;
                  a row that finished (its max_tokens, a stop string, the end of text, cancelled) leaves at once

No KV cache: a stream's memory is its state, the same after ten tokens or a million (`state_bytes`). The engine is
synchronous and knows no HTTP or threads: the scheduler (rpt/serve/scheduler.py) calls it from its own thread and
hears each stream's text through the stream's `on_event`.
"""

from __future__ import annotations

import codecs
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from rpt.models.loop_exit import Exit, RowDepths
from rpt.models.sampling import sample_rows
from rpt.models.state import cat_rows, map_state, rows


@dataclass(frozen=True)
class Sampling:
    """One stream's settings (a completion request's, checked by rpt/serve/api.py)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    depth: int | None = None  # a looped model's iterations per token (its default where None)
    exit: Exit | None = None  # a looped model's adaptive exit, at most `depth`
    ignore_eos: bool = False  # go on past the end of text (the row's state starts afresh there, as in training)


class TextOut:
    """A stream's text as its tokens' bytes arrive: whole UTF-8 characters only (a token may end inside one), and
    held back while it may be the start of a stop string, so that no stop string is ever sent."""

    def __init__(self, stop: tuple[str, ...]):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self.stop, self.held = stop, ""

    def add(self, data: bytes) -> tuple[str, bool]:
        """(the text that may be sent now, whether a stop string ended the stream)."""
        self.held += self.decoder.decode(data)
        found = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if found:
            text, self.held = self.held[:min(found)], ""
            return text, True
        keep = max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.held.endswith(s[:n])), default=0)
        text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return text, False

    def flush(self) -> str:
        text, self.held = self.held + self.decoder.decode(b"", final=True), ""
        return text


class Stream:
    """One completion choice: its prompt's token ids, its settings, how far it is, and `on_event(stream, text,
    finish_reason)`, told of each piece of text (finish_reason None) and once of its end ("stop", "length",
    "abort", "cancelled")."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], sampling: Sampling, on_event: Callable[["Stream", str, str | None], None]):
        self.id = next(Stream._ids)
        self.prompt, self.sampling, self.on_event = prompt, sampling, on_event
        self.generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        self.text = TextOut(sampling.stop)
        self.prefilled, self.state = 0, None  # the prompt's tokens run so far, and the state after them
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.cancelled = False  # set from another thread: the engine drops the stream at its next step


class Engine:
    def __init__(self, model, eot_id: int, reset_at_documents: bool, token_bytes: list[bytes],
                 prefill_chunk: int = 256):
        """`model`: a RecurrentLM in eval mode; `reset_at_documents`: the run's data.reset_at_documents (the
        state starts afresh at each end of text, in a prompt and after it, as in training)."""
        self.model, self.eot, self.reset_eot, self.table = model, eot_id, reset_at_documents, token_bytes
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.running: list[Stream] = []  # the batch's rows, in order
        self.prefilling: deque[Stream] = deque()
        self.state = None  # the running rows' states, one tree
        self.next_tokens: torch.Tensor | None = None  # [rows]: each row's last sampled token, its next input
        self.generator = torch.Generator()
        self.generator.seed()  # for the streams without a seed

    @property
    def active(self) -> int:
        return len(self.running) + len(self.prefilling)

    def state_bytes(self, streams: int = 1) -> int:
        """The recurrent state's bytes for `streams` streams (a looped model's: every loop slot's)."""
        sizes = []
        map_state(lambda t: sizes.append(t.numel() * t.element_size()) or t, self.model.init_state(1, self.device))
        return sum(sizes) * streams

    def add(self, stream: Stream) -> None:
        self.prefilling.append(stream)

    @torch.no_grad()
    def step(self) -> None:
        """One chunk of the first waiting prompt, then one token for every running row."""
        self._drop_cancelled()
        if self.prefilling:
            self._prefill(self.prefilling[0])
        if self.running:
            self._decode()

    def abort_all(self, reason: str = "abort") -> None:
        """End every stream now (a drain's grace period is over)."""
        for s in [*self.prefilling, *self.running]:
            self._finish(s, reason, s.text.flush())
        self.prefilling.clear()
        self._keep([])

    # ------------------------------------------------------------------ the steps
    def _prefill(self, s: Stream) -> None:
        ids = s.prompt[s.prefilled:s.prefilled + self.prefill_chunk]
        x = torch.tensor(ids, device=self.device)[None]
        logits, s.state = self.model.prefill(x, s.state, reset_mask=x == self.eot if self.reset_eot else None,
                                             depth=self._depth(s))
        s.prefilled += len(ids)
        if s.prefilled < len(s.prompt):
            return
        self.prefilling.popleft()
        token = self._sample(logits, [s])[0]
        if self._emit(s, token):  # it joins the batch
            self.state = s.state if self.state is None else cat_rows([self.state, s.state])
            first = torch.tensor([token], device=self.device)
            self.next_tokens = first if self.next_tokens is None else torch.cat([self.next_tokens, first])
            self.running.append(s)
        s.state = None

    def _decode(self) -> None:
        run, tokens = self.running, self.next_tokens
        k = torch.tensor([1 if s.sampling.temperature <= 0 else s.sampling.top_k for s in run], device=self.device)
        depth, stop = None, None
        if self.model.loop is not None and any(s.sampling.depth is not None or s.sampling.exit for s in run):
            per_row = torch.tensor([self._depth(s) for s in run], device=self.device)
            depth, stop = int(per_row.max()), RowDepths(per_row, [s.sampling.exit for s in run])
        logits, self.state = self.model.step(tokens, self.state, depth, stop, sample_k=k,
                                             reset=tokens == self.eot if self.reset_eot else None)
        sampled = self._sample(logits, run)
        self.next_tokens = torch.tensor(sampled, device=self.device)
        self._keep([i for i, (s, t) in enumerate(zip(run, sampled)) if self._emit(s, t)])

    def _depth(self, s: Stream) -> int | None:
        """A looped model's iterations per token for this stream: its own, or the loop's slots where it has an exit
        rule alone (the state holds that many: a stream's memory never grows), or the model's default."""
        loop, p = self.model.loop, s.sampling
        if loop is None:
            return None
        return p.depth if p.depth is not None else loop.slots if p.exit is not None else loop.default_depth

    def _sample(self, logits: torch.Tensor, streams: list[Stream]) -> list[int]:
        """Each row's next token with its own settings; a sampled row draws its one uniform number from its own
        generator (a seeded stream draws the same tokens whatever runs beside it)."""
        settings = [s.sampling for s in streams]
        uniform = [float(torch.rand((), generator=s.generator or self.generator)) if p.temperature > 0 else 0.0
                   for s, p in zip(streams, settings)]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        return sample_rows(logits, column([p.temperature for p in settings], torch.float32),
                           column([p.top_k for p in settings], torch.long),
                           column([p.top_p for p in settings], torch.float32),
                           column(uniform, torch.float64)).tolist()

    def _emit(self, s: Stream, token: int) -> bool:
        """Hand the stream its token's text; False where the stream ended with it."""
        s.tokens.append(token)
        if token == self.eot and not s.sampling.ignore_eos:
            self._finish(s, "stop", s.text.flush())
            return False
        text, stopped = s.text.add(self.table[token])
        if stopped:
            self._finish(s, "stop", text)
            return False
        if len(s.tokens) >= s.sampling.max_tokens:
            self._finish(s, "length", text + s.text.flush())
            return False
        s.on_event(s, text, None)
        return True

    def _finish(self, s: Stream, reason: str, text: str) -> None:
        s.finish_reason = reason
        s.on_event(s, text, reason)

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.prefilling if s.cancelled]:
            self.prefilling.remove(s)
            self._finish(s, "cancelled", "")
        if any(s.cancelled for s in self.running):
            for s in self.running:
                if s.cancelled:
                    self._finish(s, "cancelled", "")
            self._keep([i for i, s in enumerate(self.running) if not s.cancelled])

    def _keep(self, kept: list[int]) -> None:
        """Keep these rows of the batch, in order; the others' slots are freed."""
        if len(kept) == len(self.running):
            return
        if not kept:
            self.running, self.state, self.next_tokens = [], None, None
            return
        index = torch.tensor(kept, device=self.device)
        self.running = [self.running[i] for i in kept]
        self.state, self.next_tokens = rows(self.state, index), self.next_tokens[index]

