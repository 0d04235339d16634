"""A weighted mixture of prepared datasets (`data.mix`): one tokenizer, rows drawn from the sources by weight.

Each source is read as its own `TokenStream` of S = world x B streams. At step k the source of every one of
the S rows is drawn from (seed, k) by the weights, the same on every rank; row g then takes the next window
of source j's stream g, which advances only when row g draws j. So each source is read in its own order at
its own rate (7:3 for weights 0.7 and 0.3), no token of it is read twice before its epoch ends, and a small
source simply starts its next epoch sooner. A row that changes source is marked for a reset at its first
token, as at a document start. The loader's state (step, and how often each stream drew each source) is the
same on every rank, so a resume is exact; it needs the same S and T (another world size x batch size, or
another sequence length, is refused with the fix).

The validation split of a mixture is the sources' validation splits laid end to end (unweighted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rpt.data.dataset import PreparedData
from rpt.data.shards import ShardedTokens
from rpt.data.stream import Batch, TokenStream
from rpt.errors import RptError


class MixedData:
    """The folders of data.mix opened as one dataset: what the trainer asks of `PreparedData`."""

    def __init__(self, mix: dict[str, float]):
        self.names = list(mix)
        self.parts = [PreparedData(folder) for folder in self.names]
        self.weights = np.array([mix[n] for n in self.names], dtype=np.float64) / sum(mix.values())
        first = self.parts[0]
        for name, part in zip(self.names[1:], self.parts[1:]):
            if part.meta["tokenizer_sha256"] != first.meta["tokenizer_sha256"]:
                raise RptError(f"data.mix: {name} was prepared with another tokenizer than {self.names[0]}",
                               f"prepare it again with the same one: rpt prepare --input ... --out {name} "
                               f"--tokenizer {Path(self.names[0]) / 'tokenizer.json'} --force")
            if part.dtype != first.dtype:
                raise RptError(f"data.mix: {name} stores tokens as {part.dtype}, {self.names[0]} as {first.dtype}",
                               "prepare them with the same --dtype")
        self.path, self.meta = first.path, first.meta  # the run directory copies its meta.json and tokenizer
        self.vocab_size, self.eot_id, self.dtype = first.vocab_size, first.eot_id, first.dtype

    @property
    def tokenizer(self):
        return self.parts[0].tokenizer

    def source_tokens(self, split: str) -> list:
        return [part.tokens(split) for part in self.parts]

    def tokens(self, split: str) -> ShardedTokens:
        """Every source's split, end to end (for validation and the shortlist's token counts)."""
        files = [f for part in self.parts for f in part._files(split)]
        return ShardedTokens([f for f, _ in files], [n for _, n in files], self.dtype)

    def check_ids(self, split: str, vocab_size: int) -> None:
        for part in self.parts:
            part.check_ids(split, vocab_size)

    def num_bytes(self, split: str) -> int:
        return sum(part.num_bytes(split) for part in self.parts)

    def stream(self, batch_size: int, seq_len: int, **kw) -> "MixtureStream":
        return MixtureStream(self.names, self.source_tokens("train"), self.weights, batch_size, seq_len, **kw)


class MixtureStream:
    """Batches whose rows come from several sources by weight (module docstring); an iterator like TokenStream."""

    def __init__(self, names: list[str], sources: list, weights: np.ndarray, batch_size: int, seq_len: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0, mode: str = "stream", eot_id: int | None = None):
        self.names, self.weights = list(names), np.asarray(weights, dtype=np.float64)
        self.streams = []
        for name, tokens in zip(names, sources):
            try:
                self.streams.append(TokenStream(tokens, batch_size, seq_len, rank=rank, world_size=world_size,
                                                seed=seed, mode=mode, eot_id=eot_id))
            except RptError as exc:
                raise RptError(f"data.mix: {name}: {exc.message}", exc.fix) from None
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.S = world_size * batch_size
        self.mine = np.arange(rank * batch_size, (rank + 1) * batch_size)
        self.step = 0
        self.taken = np.zeros((len(names), self.S), dtype=np.int64)  # rows each stream took from each source
        self.last = np.full(self.S, -1, dtype=np.int64)  # the source of each stream's previous row

    def __iter__(self):
        return self

    def draw(self, step: int) -> np.ndarray:
        """The source of each of the S rows at `step`: a function of (seed, step) alone."""
        u = np.random.default_rng([self.seed, 0x313, step]).random(self.S)
        return np.minimum(np.searchsorted(np.cumsum(self.weights), u, side="right"), len(self.weights) - 1)

    def __next__(self) -> Batch:
        choice = self.draw(self.step)
        B, T = self.batch_size, self.seq_len
        x = torch.empty(B, T, dtype=torch.int64)
        y, reset = torch.empty_like(x), torch.empty(B, T, dtype=torch.bool)
        for j, stream in enumerate(self.streams):
            rows = np.flatnonzero(choice[self.mine] == j)
            steps = self.taken[j, self.mine[rows]]
            for k in np.unique(steps):  # rows at the same position of source j, read together
                at = rows[steps == k]
                part = stream.batch(int(k), streams=self.mine[at])
                x[at], y[at], reset[at] = part.x, part.y, part.reset
        reset[:, 0] |= torch.from_numpy(choice[self.mine] != self.last[self.mine])
        self.taken[choice, np.arange(self.S)] += 1
        self.last = choice
        self.step += 1
        return Batch(x, y, reset)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens every rank together has read from each source so far."""
        return {name: int(self.taken[j].sum()) * self.seq_len for j, name in enumerate(self.names)}

    def state_dict(self) -> dict:
        return {"mixture": self.names, "weights": self.weights.tolist(), "step": self.step,
                "taken": self.taken.tolist(), "last": self.last.tolist(), "streams": self.S, "seq_len": self.seq_len,
                "seed": self.seed, "tokens": [len(s.tokens) for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        if "mixture" not in state:
            raise RptError("the checkpoint's loader read one dataset, this run a mixture (data.mix)",
                           "resume with the data settings of the run that wrote it")
        saved = {k: state[k] for k in ("mixture", "weights", "streams", "seq_len", "seed", "tokens")}
        now = {k: v for k, v in self.state_dict().items() if k in saved}
        same = lambda k: (len(saved[k]) == len(now[k]) and np.allclose(saved[k], now[k])  # noqa: E731
                          if k == "weights" else saved[k] == now[k])
        diff = [k for k in saved if not same(k)]
        if diff:
            listed = ", ".join(f"{k}: saved {saved[k]} now {now[k]}" for k in diff)
            raise RptError(f"the mixture's loader state does not fit this run ({listed})",
                           "resume a mixture with the same data.mix, train.seed, train.seq_len and world size x "
                           "batch size as the run that wrote it")
        self.step = int(state["step"])
        self.taken = np.asarray(state["taken"], dtype=np.int64)
        self.last = np.asarray(state["last"], dtype=np.int64)


def open_dataset(data_cfg) -> PreparedData | MixedData:
    """The data a run reads: data.mix's folders as one mixture when it is set, else data.path."""
    return MixedData(data_cfg.mix) if data_cfg.mix else PreparedData(data_cfg.path)
