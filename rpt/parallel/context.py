"""Context parallelism (`parallel.cp = N`): one window's time axis split over N ranks, each running its piece.

Rank i of a cp group reads the same rows as the others and runs tokens [i T/N, (i+1) T/N) through the whole model;
what crosses a piece's edge is each sub-layer's recurrent state, so that is all the ranks exchange:

- a cell whose piece's effect on the state can be summarised from the piece's own inputs (its `piece_forward`:
  the scans, h_t = a_t h_{t-1} + b_t, by (product of a, final state from zero); mlstm by its memory at the end
  and its gate sums; gdn by the affine map S -> A S + B, after its convolution's last inputs as a halo) runs its
  piece at once: one all-gather of the summaries, each rank folds the earlier ones into the window's state with
  the cell's `fold` and finishes its piece from there (`entering`); backward mirrors it (`_Entering`);
- the non-linear cells (lstm, gru, modlstm) and sliding-window attention (whose state is its last window of keys
  and values) take their first state from the rank before and hand their last to the rank after (`_Receive`,
  `_Send`); state gradients travel back the same way. Block by block this is a pipeline in time: rank i runs
  block b while rank i-1 runs block b+1, in forward and, reversed, in backward.

Each rank's loss is the mean over its piece; the gradient sync averages over every rank of the job (cp x data
ranks), which is the mean over the window. The state carried to the next window is the last piece's, broadcast to
the group; a validation's losses come back whole on the group's first rank. Applied from outside the model, as the
checkpointing of apply.py is; written here because torch's context parallelism covers attention only.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import torch
import torch.distributed as dist

from rpt.models.state import map_state
from rpt.ops.stack.spec import at_least_fp32

TAGS = 16  # message tags per sub-layer: one per tensor of its state


class ContextGroup:
    """This rank's place among the `size` ranks that share its windows (consecutive global ranks), their process
    group and the point-to-point sends still in flight."""

    def __init__(self, size: int, rank: int, world_size: int):
        self.size, self.rank = size, rank % size
        self.first = rank - self.rank
        self.group = None
        for start in range(0, world_size, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + size)))
            if start == self.first:
                self.group = group
        self.prev = rank - 1 if self.rank > 0 else None
        self.next = rank + 1 if self.rank < size - 1 else None
        self.last = self.first + size - 1
        self._sending: list = []  # (work, tensor): a send's buffer lives until it is known sent

    def piece(self, length: int) -> slice:
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def send(self, tensors, tag: int, dst: int) -> None:
        """States and their gradients travel in float32 or wider (each side's dtype may differ under autocast)."""
        for i, t in enumerate(tensors):
            t = at_least_fp32(t.detach()).contiguous()
            self._sending.append((dist.isend(t, dst, group=self.group, tag=TAGS * tag + i), t))

    def receive(self, like, tag: int, src: int) -> list[torch.Tensor]:
        """Tensors of `like`'s shapes and dtypes, from `src`."""
        got = []
        for i, t in enumerate(like):
            wire = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype  # as `send` sends it
            buffer = torch.empty(t.shape, dtype=wire, device=t.device)
            dist.recv(buffer, src, group=self.group, tag=TAGS * tag + i)
            got.append(buffer.to(t.dtype))
        return got

    def settle(self) -> None:
        """Wait for the sends of the last step (each was received: this returns at once)."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()

    def from_last(self, state):
        """The state after the window (the last piece's), the same on every rank of the group."""
        def share(t):
            t = t.detach().contiguous()
            dist.broadcast(t, self.last, group=self.group)
            return t
        with torch.no_grad():
            return map_state(share, state)

    def whole(self, piece: torch.Tensor) -> torch.Tensor | None:
        """The window's [B, T] losses from every rank's [B, T/N] piece, on the group's first rank (None on the rest,
        as on a pipeline stage before the last: a validation adds only the first rank's)."""
        pieces = [torch.empty_like(piece) for _ in range(self.size)]
        dist.all_gather(pieces, piece.contiguous(), group=self.group)
        return torch.cat(pieces, 1) if self.rank == 0 else None


class _Receive(torch.autograd.Function):
    """The state entering this piece, from the rank before; its gradient goes back there."""

    @staticmethod
    def forward(ctx, cp, tag, anchor, *like):
        ctx.cp, ctx.tag = cp, tag
        got = cp.receive(like, tag, cp.prev)
        ctx.like = [t.detach() for t in got]  # their shapes (a state is small)
        return tuple(got)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, ctx.like)]
        ctx.cp.send(grads, ctx.tag, ctx.cp.prev)
        return (None, None, None, *(None for _ in grads))


class _Send(torch.autograd.Function):
    """y unchanged, with the state leaving this piece sent to the rank after; in backward that state's gradient
    comes back from there (before y's part of this sub-layer's backward can finish)."""

    @staticmethod
    def forward(ctx, cp, tag, y, *state):
        ctx.cp, ctx.tag = cp, tag
        ctx.like = [s.detach() for s in state]
        cp.send(state, tag, cp.next)
        return y.clone()

    @staticmethod
    def backward(ctx, grad_y):
        grads = ctx.cp.receive(ctx.like, ctx.tag, ctx.cp.next)
        return (None, None, grad_y, *grads)


def _handed_on(forward, cp: ContextGroup, tag: int, x, state, reset=None):
    """A sub-layer whose state crosses the piece's edges whole: its first state from the rank before."""
    if cp.prev is not None:
        anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())  # so that the received state has a backward
        state = _Receive.apply(cp, tag, anchor, *state)
    y, new = forward(x, state, reset)
    if cp.next is not None:
        y = _Send.apply(cp, tag, y, *new)
    return y, new


class _Entering(torch.autograd.Function):
    """The state entering this rank's piece: every piece's summary (flat [n]) all-gathered, and the earlier ones
    folded into the window's state with the cell's `fold`. Backward: the fold's gradient by autograd on the gathered
    summaries; each rank's gradient of every summary summed over the group (one all-reduce), its own slot. Every
    rank returns new tensors, so that every rank's backward runs the all-reduce."""

    @staticmethod
    def forward(ctx, cp, fold, unflatten, flat, *state):
        gathered = [torch.empty_like(flat) for _ in range(cp.size)]
        dist.all_gather(gathered, flat.contiguous(), group=cp.group)
        ctx.cp, ctx.fold, ctx.unflatten = cp, fold, unflatten
        ctx.save_for_backward(torch.stack(gathered), *state)
        return tuple(t.detach() for t in _fold(cp.rank, fold, unflatten, gathered, state))

    @staticmethod
    def backward(ctx, *grads):
        gathered, *state = ctx.saved_tensors
        with torch.enable_grad():
            pieces = gathered.detach().requires_grad_()
            start = [t.detach().requires_grad_() for t in state]
            out = _fold(ctx.cp.rank, ctx.fold, ctx.unflatten, pieces.unbind(0), start)
            found = torch.autograd.grad(out, [pieces, *start], grads, allow_unused=True)
        of_pieces = found[0] if found[0] is not None else torch.zeros_like(pieces)
        dist.all_reduce(of_pieces, group=ctx.cp.group)
        return (None, None, None, of_pieces[ctx.cp.rank], *found[1:])


def _fold(rank: int, fold, unflatten, pieces, state):
    state = tuple(state)
    for j in range(rank):
        state = tuple(fold(unflatten(pieces[j]), state))
    return tuple(t * 1 for t in state)  # a new tensor even where nothing is folded (rank 0)


def entering(cp: ContextGroup, own: tuple, state: tuple, fold) -> tuple:
    """The state entering this rank's piece, from every rank's summary `own` of its piece (a tuple of tensors, the
    same shapes on every rank) and the window's `state`: the earlier pieces' folded into it in order. Summaries
    travel in float32 at least."""
    wide = functools.reduce(torch.promote_types, [t.dtype for t in own], torch.float32)
    shapes = [t.shape for t in own]

    def unflatten(flat):
        parts, at = [], 0
        for shape in shapes:
            n = math.prod(shape)
            parts.append(flat[at:at + n].view(shape))
            at += n
        return tuple(parts)
    flat = torch.cat([t.to(wide).reshape(-1) for t in own])
    return _Entering.apply(cp, fold, unflatten, flat, *state)


def split_windows(model, cp: ContextGroup) -> None:
    """Make `model(x, state, reset, targets)` (a RecurrentLM, before data parallelism wraps it) run this rank's
    piece of each window, its sub-layers exchanging their states with the group's other ranks."""
    for index, block in model.blocks.items():
        cell = block.cell
        if cell.piece_forward is not None:  # its piece at once, from the state the earlier pieces leave
            cell.forward = partial(cell.piece_forward, entering=partial(entering, cp))
        else:
            cell.forward = partial(_handed_on, cell.forward, cp, 2 * int(index))
        if block.attn is not None:
            block.attn.forward = partial(_handed_on, block.attn.forward, cp, 2 * int(index) + 1)
    plain = model.forward

    def forward(x, state=None, reset_mask=None, targets=None, **kw):
        cp.settle()
        part = cp.piece(x.shape[1])
        out, state = plain(x[:, part], state, None if reset_mask is None else reset_mask[:, part],
                           None if targets is None else targets[:, part], **kw)
        state = cp.from_last(state)
        if targets is not None and not torch.is_grad_enabled():
            out = cp.whole(out)
        return out, state

    model.forward = forward
