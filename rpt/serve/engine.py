"""The serving engine: many streams generated as one batch, each holding one fixed-size recurrent state.

    admitted streams -> their prompts through the sequence form together, every row advancing by the same number
                        of tokens a step (at most `prefill_chunk`)
                     -> each one's first token sampled, its state joins the running batch (rows of one state tree)
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

from rpt.models.decoder import Decoder
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
                 prefill_chunk: int = 256, prefill_tokens: int = 8192, decoder: Decoder | None = None):
        """`model`: a RecurrentLM in eval mode; `reset_at_documents`: the run's data.reset_at_documents (the
        state starts afresh at each end of text, in a prompt and after it, as in training). A step prefills the
        waiting prompts together, `prefill_chunk` tokens of each, at most `prefill_tokens` tokens in all.
        `decoder`: what picks each row's token (rpt/models/decoder.py; the model's own with F.linear if none)."""
        self.model, self.eot, self.reset_eot, self.table = model, eot_id, reset_at_documents, token_bytes
        self.decoder = decoder or Decoder(model)
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.device = next(model.parameters()).device
        self.running: list[Stream] = []  # the batch's rows, in order
        self.prefilling: deque[Stream] = deque()
        self.state = None  # the running rows' states, one tree
        self.next_ids: list[int] = []  # each running row's last sampled token, its next input
        self.generator = torch.Generator()
        self.generator.seed()  # for the streams without a seed
        sizes = []  # one stream's state, counted once (the gauges read it at every step)
        map_state(lambda t: sizes.append(t.numel() * t.element_size()) or t, model.init_state(1, self.device))
        self.bytes_per_stream = sum(sizes)

    @property
    def active(self) -> int:
        return len(self.running) + len(self.prefilling)

    def state_bytes(self, streams: int = 1) -> int:
        """The recurrent state's bytes for `streams` streams (a looped model's: every loop slot's)."""
        return self.bytes_per_stream * streams

    def add(self, stream: Stream) -> None:
        self.prefilling.append(stream)

    @torch.no_grad()
    def step(self) -> None:
        """Pieces of the waiting prompts, up to `prefill_tokens` in all, then one token for every running row."""
        self._drop_cancelled()
        budget = self.prefill_tokens
        while self.prefilling and budget > 0:
            budget -= self._prefill(budget)
        if self.running:
            self._decode()

    def abort_all(self, reason: str = "abort") -> None:
        """End every stream now (a drain's grace period is over)."""
        for s in [*self.prefilling, *self.running]:
            self._finish(s, reason, s.text.flush())
        self.prefilling.clear()
        self._keep([])

    # ------------------------------------------------------------------ the steps
    def _prefill(self, budget: int) -> int:
        """The next piece of the waiting prompts of one depth, as one batch in which every row advances by the same
        number of tokens (the fewest any of them has left, at most `prefill_chunk`): no padding, and no reset but
        at an end of text inside a prompt (a reset where rows differ splits the sequence form into segments). A
        prompt that ends here is sampled and joins the running rows. At most `budget` tokens; returns how many ran
        (a step runs pieces until its --prefill-tokens are spent: prompts of many lengths need a piece per length)."""
        depth = self._depth(self.prefilling[0])
        batch = [s for s in self.prefilling if self._depth(s) == depth]
        width = min(self.prefill_chunk, budget, *(len(s.prompt) - s.prefilled for s in batch))
        batch = batch[:max(1, budget // width)]
        width = min(self.prefill_chunk, budget, *(len(s.prompt) - s.prefilled for s in batch))
        pieces = [s.prompt[s.prefilled:s.prefilled + width] for s in batch]
        x = torch.tensor(pieces, device=self.device)
        reset = None
        if self.reset_eot:
            reset = x == self.eot
            reset[:, 0] &= torch.tensor([s.prefilled > 0 for s in batch], device=self.device)  # (fresh rows: no need)
            reset = reset if bool(reset.any()) else None
        fresh = self.model.init_state(1, self.device)
        state = cat_rows([s.state if s.state is not None else fresh for s in batch])
        h, state = self.model.prefill_hidden(x, state, reset_mask=reset, depth=depth)
        done = []
        for row, (s, p) in enumerate(zip(batch, pieces)):
            s.prefilled += len(p)
            if s.prefilled < len(s.prompt):
                s.state = rows(state, slice(row, row + 1))
            else:
                done.append(row)
        if not done:
            return width * len(batch)
        finished = [batch[row] for row in done]
        self.prefilling = deque(s for s in self.prefilling if s not in finished)
        tokens = self._pick(h[done], finished)
        joining = [(row, s, t) for row, s, t in zip(done, finished, tokens) if self._emit(s, t)]
        if joining:
            joined = rows(state, torch.tensor([row for row, _, _ in joining], device=self.device))
            self.state = joined if self.state is None else cat_rows([self.state, joined])
            self.running += [s for _, s, _ in joining]
            self.next_ids += [t for _, _, t in joining]
        for s in finished:
            s.state = None
        return width * len(batch)

    def _decode(self) -> None:
        run, ids = self.running, self.next_ids
        tokens = torch.tensor(ids, device=self.device)
        depth, stop = None, None
        if self.model.loop is not None and any(s.sampling.depth is not None or s.sampling.exit for s in run):
            per_row = torch.tensor([self._depth(s) for s in run], device=self.device)
            depth, stop = int(per_row.max()), RowDepths(per_row, [s.sampling.exit for s in run])
        reset = tokens == self.eot if self.reset_eot and self.eot in ids else None  # (ignore_eos rows only)
        h, self.state = self.model.step_hidden(tokens, self.state, depth, stop, reset=reset)
        sampled = self._pick(h, run)
        self.next_ids = sampled
        self._keep([i for i, (s, t) in enumerate(zip(run, sampled)) if self._emit(s, t)])

    def _depth(self, s: Stream) -> int | None:
        """A looped model's iterations per token for this stream: its own, or the loop's slots where it has an exit
        rule alone (the state holds that many: a stream's memory never grows), or the model's default."""
        loop, p = self.model.loop, s.sampling
        if loop is None:
            return None
        return p.depth if p.depth is not None else loop.slots if p.exit is not None else loop.default_depth

    def _pick(self, h: torch.Tensor, streams: list[Stream]) -> list[int]:
        """Each stream's next token from its row of the final hidden states `h`: the most probable where every row
        is greedy (no [rows, vocabulary] logits), else sampled from the logits each row can draw from."""
        if all(s.sampling.temperature <= 0 for s in streams):
            return self.decoder.greedy(h).tolist()
        ks = [1 if s.sampling.temperature <= 0 else s.sampling.top_k for s in streams]
        k = ks[0] if ks.count(ks[0]) == len(ks) else torch.tensor(ks, device=self.device)
        return self._sample(self.decoder.sampling_logits(h, k), streams)

    def _sample(self, logits: torch.Tensor, streams: list[Stream]) -> list[int]:
        """Each row's next token with its own settings; a sampled row draws its one uniform number from its own
        generator (a seeded stream draws the same tokens whatever runs beside it)."""
        settings = [s.sampling for s in streams]
        if all(p.temperature <= 0 for p in settings):
            return logits.argmax(dim=-1).tolist()
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
            self.running, self.state, self.next_ids = [], None, []
            return
        self.running = [self.running[i] for i in kept]
        self.state = rows(self.state, torch.tensor(kept, device=self.device))
        self.next_ids = [self.next_ids[i] for i in kept]

