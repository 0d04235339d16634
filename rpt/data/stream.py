"""`TokenStream`: batches for truncated backpropagation through time, resumable to the batch, on any world size.

Stream mode (the default) cuts a split into S = world_size * B equal contiguous streams, numbered globally;
rank r reads streams r*B .. r*B+B-1, so ranks read disjoint tokens. Batch k takes the k-th window of T
tokens from each of its streams, so row b of batch k+1 continues row b of batch k and the recurrent state
can carry over between steps. Each epoch after the first shifts all windows by a seeded offset below T, so
the model does not see the same cuts forever; the first batch of every epoch marks column 0 for a reset,
since its rows do not continue the previous batch.

The same stream on another layout. The order of the tokens is a function of S and T alone, not of how the S
streams are spread over ranks: a run resumed with another world size and batch size whose product is S reads
exactly the streams it would have read (only the recurrent state starts afresh). When S or T changes, the
rest of the epoch (the unread part of every old stream, in stream order) is cut into S new streams and read
to its end, each jump between old streams marked as a reset; then epochs go on in the new geometry. No token
is skipped or read twice at the change; what is left at the end of that epoch is less than one batch of
every stream, as at the end of any epoch.

Random mode draws windows at random offsets, nanoGPT style, for stateless training: step k's S windows are a
function of (seed, k) alone, rank r taking its B of them, so a resume (on any layout) needs only the step.

The reset mask marks the positions where a document starts (the end-of-document token opens every document),
so a model can reset its state there. Torch's DataLoader is not used: the batches are cheap slices of a
memmap, and what TBPTT needs (row b continues row b, exact resume at a batch) is the order itself, which a
sampler-based loader does not promise.
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
        self.streams = world_size * batch_size
        self.seed, self.mode, self.eot_id = seed, mode, eot_id
        self.step = 0
        # where the present geometry took over: (loader step, epoch), and the rest of an epoch of an earlier
        # geometry that it reads first ([2, P]: starts and lengths of pieces of the split), if any
        self.origin = (0, 0)
        self._use_remainder(None)
        n = len(tokens)
        if mode == "stream":
            self.stream_len = (n - 1) // self.streams
            if self.stream_len < 2 * seq_len:
                raise RptError(
                    f"{n} tokens are too few for {self.streams} streams of at least {2 * seq_len} tokens "
                    f"(world size {world_size} x batch {batch_size}, 2 x seq_len {seq_len})",
                    "lower train.batch_size or train.seq_len, or use more data")
            self.batches_per_epoch = self.stream_len // seq_len - 1
        else:
            if n < seq_len + 2:
                raise RptError(f"{n} tokens are too few for windows of {seq_len}", "lower train.seq_len or use more data")
            self.batches_per_epoch = max(1, (n - 1) // (self.streams * seq_len))
        self._window = np.arange(seq_len + 1, dtype=np.int64)
        self._mine = np.arange(rank * batch_size, (rank + 1) * batch_size, dtype=np.int64)  # my global streams

    @property
    def epoch(self) -> int:
        return self._where(self.step)[0]

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    # ----------------------------------------------------------------- positions
    def _use_remainder(self, pieces: np.ndarray | None) -> None:
        """Read `pieces` first ([2, P] starts and lengths, or None); what every batch needs of them, once."""
        self.remainder = pieces
        self._piece_ends = np.cumsum(pieces[1]) if pieces is not None else None
        self._remainder_batches = (int(self._piece_ends[-1]) // self.streams // self.seq_len
                                   if pieces is not None and len(pieces[1]) else 0)

    def _where(self, step: int) -> tuple[int, int, bool]:
        """(epoch, batch within it, whether that epoch is an earlier geometry's remainder) of `step`."""
        since, epoch = step - self.origin[0], self.origin[1]
        if self.remainder is not None:
            if since < self._remainder_batches:
                return epoch, since, True
            since, epoch = since - self._remainder_batches, epoch + 1
        e, k = divmod(since, self.batches_per_epoch)
        return epoch + e, k, False

    def _starts(self, epoch: int, streams: np.ndarray) -> np.ndarray:
        """Where the given streams begin in a regular epoch (physical positions of their first inputs)."""
        return streams * self.stream_len + self._epoch_offset(epoch)

    def _virtual_to_physical(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the remainder (its pieces laid end to end) -> positions in the split, and whether each
        is the first of its piece (the text jumps there)."""
        starts, lengths = self.remainder
        before = self._piece_ends - lengths
        j = np.searchsorted(before, v, side="right") - 1
        return starts[j] + (v - before[j]), v == before[j]

    def batch(self, step: int, streams: np.ndarray | None = None) -> Batch:
        """The batch at `step`, without moving the stream (a pure function of the geometry, seed and step); of
        the given global streams instead of this rank's when `streams` is set (a mixture reads so)."""
        T = self.seq_len
        mine = self._mine if streams is None else np.asarray(streams, dtype=np.int64)
        epoch, k, in_remainder = self._where(step)
        jumps = None
        if self.mode == "random":
            rng = np.random.default_rng([self.seed, step])
            starts = rng.integers(0, len(self.tokens) - T - 1, size=self.streams, endpoint=True)[mine]
            positions, epoch_start = starts[:, None] + self._window, True
        elif in_remainder:
            length = self._remainder_batches * T  # each new stream's share of the remainder
            v = (mine * length + k * T)[:, None] + self._window[:-1]
            x_pos, jumps = self._virtual_to_physical(v)
            positions, epoch_start = np.concatenate([x_pos, x_pos[:, -1:] + 1], axis=1), k == 0
        else:
            positions, epoch_start = (self._starts(epoch, mine) + k * T)[:, None] + self._window, k == 0
        chunk = torch.from_numpy(self.tokens[positions].astype(np.int64))
        x = chunk[:, :-1]
        y = chunk[:, 1:] if jumps is None else torch.from_numpy(self.tokens[positions[:, :-1] + 1].astype(np.int64))
        reset = x == self.eot_id if self.eot_id is not None else torch.zeros_like(x, dtype=torch.bool)
        if jumps is not None:
            reset |= torch.from_numpy(jumps)
        if epoch_start:  # rows do not continue the previous batch
            reset[:, 0] = True
        return Batch(x, y, reset)

    def _epoch_offset(self, epoch: int) -> int:
        if epoch == 0:
            return 0
        return int(np.random.default_rng([self.seed, 0x5EED, epoch]).integers(0, self.seq_len))

    def unread(self) -> tuple[int, np.ndarray]:
        """(epoch, [2, P] pieces) of what every stream has still to read in the present epoch, in stream order."""
        T = self.seq_len
        epoch, k, in_remainder = self._where(self.step)
        every = np.arange(self.streams, dtype=np.int64)
        if not in_remainder:
            first = self._starts(epoch, every) + k * T
            return epoch, np.stack([first, np.full_like(first, (self.batches_per_epoch - k) * T)])
        length = self._remainder_batches * T
        (starts, lengths), ends = self.remainder, self._piece_ends
        pieces = []
        for i in every:  # an old stream's unread span may cross pieces of the remainder
            v, stream_end = int(i * length + k * T), int((i + 1) * length)
            while v < stream_end:
                j = int(np.searchsorted(ends, v, side="right"))  # the piece holding v
                stop = min(stream_end, int(ends[j]))
                pieces.append((int(starts[j] + v - (ends[j] - lengths[j])), stop - v))
                v = stop
        return epoch, np.array(pieces, dtype=np.int64).T.reshape(2, -1)

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        return {"step": self.step, "origin": list(self.origin),
                "remainder": None if self.remainder is None else self.remainder.tolist(), **self._geometry()}

    def load_state_dict(self, state: dict) -> None:
        """The saved position, in this stream's geometry: exactly where it was when S and T are the same (on any
        ranks), else from the rest of the saved epoch (module docstring)."""
        same = ("mode", "seed", "tokens")
        diff = {k: (state.get(k), getattr(self, k) if k != "tokens" else len(self.tokens)) for k in same
                if state.get(k) != (getattr(self, k) if k != "tokens" else len(self.tokens))}
        if diff:
            listed = ", ".join(f"{k}: saved {a} now {b}" for k, (a, b) in diff.items())
            raise RptError(f"the loader state does not fit this run ({listed})",
                           "resume with the same data, data.loader and train.seed as the run that wrote it")
        step = int(state["step"])
        streams = state.get("streams", state["world_size"] * state["batch_size"])  # before rpt kept it
        if self.mode == "random" or (streams, state["seq_len"]) == (self.streams, self.seq_len):
            self.step, self.origin = step, tuple(state.get("origin", (0, 0)))
            remainder = state.get("remainder")
            self._use_remainder(None if remainder is None else np.asarray(remainder, dtype=np.int64))
            return
        saved = TokenStream(self.tokens, streams, state["seq_len"], seed=self.seed, mode=self.mode)
        saved.load_state_dict({**state, "streams": streams, "batch_size": streams, "world_size": 1, "rank": 0})
        epoch, pieces = saved.unread()
        self.step, self.origin = step, (step, epoch)
        self._use_remainder(pieces)
        if pieces[1].sum() == saved.streams * saved.batches_per_epoch * saved.seq_len:
            self._use_remainder(None)  # at an epoch's start: the whole epoch, in this geometry
        elif self._remainder_batches == 0:  # less than a batch of every stream left: the next epoch
            self.origin = (step, epoch + 1)
            self._use_remainder(None)

    def _geometry(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "rank": self.rank, "world_size": self.world_size, "streams": self.streams, "tokens": len(self.tokens)}
