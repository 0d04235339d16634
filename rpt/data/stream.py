"""`TokenStream`: batches for truncated backpropagation through time, resumable to the batch.

Stream mode (the default) cuts a split into `world_size * B` equal contiguous streams; rank r
owns streams r*B .. r*B+B-1, so ranks read disjoint tokens. Batch k takes the k-th window of
T tokens from each of its streams, so row b of batch k+1 continues row b of batch k and the
recurrent state can carry over between steps. Each epoch after the first shifts all windows
by a seeded offset below T, so the model does not see the same cuts forever; the first batch
of every epoch marks column 0 for a reset, since its rows do not continue the previous batch.

Random mode draws B windows at random offsets, nanoGPT style, for stateless training. Each
batch's draw is a function of (seed, rank, step) alone, so resuming needs only the step.

The reset mask marks the positions where a document starts (the end-of-document token opens
every document), so a model can reset its state there. Torch's DataLoader is not used: the
batches are cheap slices of a memmap, and what TBPTT needs (row b continues row b, exact
resume at a batch) is the order itself, which a sampler-based loader does not promise.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rpt.errors import RptError


class Batch(NamedTuple):
    x: torch.Tensor  # [B, T] int64 input tokens
    y: torch.Tensor  # [B, T] int64 targets (x shifted by one)
    reset: torch.Tensor  # [B, T] bool: reset the recurrent state before consuming x[b, t]


class TokenStream:
    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, mode: str = "stream", eot_id: int | None = None):
        if mode not in ("stream", "random"):
            raise RptError(f"unknown loader mode '{mode}'", "use data.loader = 'stream' or 'random'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.seed, self.mode, self.eot_id = seed, mode, eot_id
        self.step = 0
        n = len(tokens)
        if mode == "stream":
            self.stream_len = (n - 1) // (world_size * batch_size)
            if self.stream_len < 2 * seq_len:
                raise RptError(
                    f"{n} tokens are too few for {world_size * batch_size} streams of at least {2 * seq_len} tokens "
                    f"(world size {world_size} x batch {batch_size}, 2 x seq_len {seq_len})",
                    "lower train.batch_size or train.seq_len, or use more data")
            self.batches_per_epoch = self.stream_len // seq_len - 1
            first = rank * batch_size
            self._stream_starts = (np.arange(first, first + batch_size, dtype=np.int64) * self.stream_len)
        else:
            if n < seq_len + 2:
                raise RptError(f"{n} tokens are too few for windows of {seq_len}", "lower train.seq_len or use more data")
            self.batches_per_epoch = max(1, (n - 1) // (world_size * batch_size * seq_len))
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self.step // self.batches_per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def batch(self, step: int) -> Batch:
        """The batch at `step`, without moving the stream (a pure function of the geometry, seed and step)."""
        T = self.seq_len
        epoch, k = divmod(step, self.batches_per_epoch)
        if self.mode == "stream":
            starts = self._stream_starts + self._epoch_offset(epoch) + k * T
            epoch_start = k == 0
        else:
            rng = np.random.default_rng([self.seed, self.rank, step])
            starts = rng.integers(0, len(self.tokens) - T - 1, size=self.batch_size, endpoint=True)
            epoch_start = True
        chunk = torch.from_numpy(self.tokens[starts[:, None] + self._window].astype(np.int64))
        x, y = chunk[:, :-1], chunk[:, 1:]
        reset = x == self.eot_id if self.eot_id is not None else torch.zeros_like(x, dtype=torch.bool)
        if epoch_start:  # rows do not continue the previous batch
            reset[:, 0] = True
        return Batch(x, y, reset)

    def _epoch_offset(self, epoch: int) -> int:
        if epoch == 0:
            return 0
        return int(np.random.default_rng([self.seed, 0x5EED, epoch]).integers(0, self.seq_len))

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        return {"step": self.step, **self._geometry()}

    def load_state_dict(self, state: dict) -> None:
        mine = self._geometry()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            listed = ", ".join(f"{k}: saved {a} now {b}" for k, (a, b) in diff.items())
            fix = "resume with the same data, batch size, sequence length, seed and world size"
            if "world_size" in diff:
                fix = (f"resume with --nproc {state.get('world_size')} (or torchrun with that many ranks), as the run "
                       "was written")
            raise RptError(f"the loader state does not fit this run ({listed})", fix)
        self.step = int(state["step"])

    def _geometry(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "rank": self.rank, "world_size": self.world_size, "tokens": len(self.tokens)}
