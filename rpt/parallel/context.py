"""Context parallelism (`parallel.cp = N`): one window's time axis split over N ranks, each running its piece.

Rank i of a cp group reads the same rows as the others and runs tokens [i T/N, (i+1) T/N) through the whole model;
what crosses a piece's edge is each sub-layer's recurrent state, so that is all the ranks exchange:

- the scan cells (minGRU, minLSTM: h_t = a_t h_{t-1} + b_t) scan their pieces at once from a zero state, then one
  all-gather of each piece's (product of a, final state) gives every rank the state entering its piece, and
  h_t += (product of a up to t) * that state corrects the piece locally; backward mirrors it (`_CarryIn`);
- the matrix memory (mlstm) alike: each piece's summary (what it does to the state entering it: its own memory at
  its end and its gate sums; rpt/ops/mlstm/chunkwise.py) is all-gathered, every rank folds the earlier pieces'
  summaries into the window's state to get its own first state, and runs its piece chunkwise from it (`_Entering`);
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

import math
from functools import partial

import torch
import torch.distributed as dist

from rpt.kernels.cpu.products import linear
from rpt.models.cells.minrnn import _BUILT_IN, _MinRNN
from rpt.models.cells.mlstm import MLSTM
from rpt.models.state import map_state
from rpt.ops.minrnn import sequence
from rpt.ops.minrnn.scan import linear_scan
from rpt.ops.mlstm.chunkwise import Summary, advance, chunkwise, summary
from rpt.ops.mlstm.spec import project, read_out
from rpt.ops.precision import as_fp32
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


class _CarryIn(torch.autograd.Function):
    """The state entering this rank's piece of a linear scan, from every piece's (product of a, final state from
    zero) [2, B, H]: c = fold over the earlier pieces j of c * prod_j + end_j. Backward: each rank's gradient of
    the ends it read, summed over the group (one all-reduce), its own slot."""

    @staticmethod
    def forward(ctx, cp, ends):
        gathered = [torch.empty_like(ends) for _ in range(cp.size)]
        dist.all_gather(gathered, ends.contiguous(), group=cp.group)
        ctx.cp = cp
        ctx.save_for_backward(torch.stack(gathered))
        carry = torch.zeros_like(ends[1])
        for j in range(cp.rank):
            carry = gathered[j][0] * carry + gathered[j][1]
        return carry

    @staticmethod
    def backward(ctx, grad):
        (ends,) = ctx.saved_tensors
        cp = ctx.cp
        carries = [torch.zeros_like(ends[0, 1])]  # the carry before each earlier piece
        for j in range(cp.rank):
            carries.append(ends[j, 0] * carries[-1] + ends[j, 1])
        grads = torch.zeros_like(ends)
        for j in reversed(range(cp.rank)):
            grads[j, 0] = grad * carries[j]
            grads[j, 1] = grad
            grad = grad * ends[j, 0]
        dist.all_reduce(grads, group=cp.group)
        return None, grads[cp.rank]


def _scan_piece(cell: _MinRNN, cp: ContextGroup, x, state=None, reset=None):
    """A minGRU / minLSTM cell over this rank's piece: its scan from zero (from the carried state on the first
    rank), corrected by the state entering the piece. The cell's own forward, with the exchange in its middle."""
    (h0,) = state
    u = linear(x, cell.in_proj.weight, cell.in_proj.bias)
    start = h0 if cp.prev is None else torch.zeros_like(h0)
    h, _ = sequence.forward(u, start, reset, _BUILT_IN.get(type(cell).coefficients), cell.coefficients)
    with torch.autocast(u.device.type, enabled=False):
        a, _ = cell.coefficients(as_fp32(u))
        if reset is not None:
            a = a * (~reset).to(a.dtype)[..., None]
        decay = linear_scan(a, torch.zeros_like(a), torch.ones_like(a[:, 0]))  # product of a up to each step
        h = as_fp32(h)
        carry = _CarryIn.apply(cp, torch.stack([decay[:, -1], h[:, -1]]))
        h = torch.addcmul(h, decay, carry[:, None])
    return linear(h, cell.out_proj.weight), (h[:, -1].to(h0.dtype),)


class _Entering(torch.autograd.Function):
    """The mLSTM state entering this rank's piece: every piece's summary (flat [n]) all-gathered, and the earlier
    ones folded into the window's state with `advance`. Backward: the fold's gradient by autograd on the gathered
    summaries; each rank's gradient of every summary summed over the group (one all-reduce), its own slot."""

    @staticmethod
    def forward(ctx, cp, unflatten, flat, *state):
        gathered = [torch.empty_like(flat) for _ in range(cp.size)]
        dist.all_gather(gathered, flat.contiguous(), group=cp.group)
        ctx.cp, ctx.unflatten = cp, unflatten
        ctx.save_for_backward(torch.stack(gathered), *state)
        return tuple(t.detach() for t in _fold(cp.rank, unflatten, gathered, state))

    @staticmethod
    def backward(ctx, *grads):
        gathered, *state = ctx.saved_tensors
        with torch.enable_grad():
            pieces = gathered.detach().requires_grad_()
            start = [t.detach().requires_grad_() for t in state]
            out = _fold(ctx.cp.rank, ctx.unflatten, pieces.unbind(0), start)
            found = torch.autograd.grad([o for o in out], [pieces, *start], grads, allow_unused=True)
        of_pieces = found[0] if found[0] is not None else torch.zeros_like(pieces)
        dist.all_reduce(of_pieces, group=ctx.cp.group)
        return (None, None, of_pieces[ctx.cp.rank], *found[1:])


def _fold(rank: int, unflatten, pieces, state):
    for j in range(rank):
        state = advance(state, unflatten(pieces[j]))
    return tuple(t * 1 for t in state)  # a new tensor even where nothing is folded (rank 0)


def _mlstm_piece(cell: MLSTM, cp: ContextGroup, x, state=None, reset=None):
    """An mlstm cell over this rank's piece, from the state the earlier pieces leave (`_Entering`)."""
    q, k, v, i_pre, log_f, o = project(x, cell.qkvo.weight, cell.gates.weight, cell.gates.bias, cell.heads, linear)
    q, k, v, i_pre, log_f = (t.transpose(1, 2) for t in (q, k, v, i_pre, log_f))  # [B, heads, T, ...]
    with torch.autocast(x.device.type, enabled=False):
        wide = torch.promote_types(q.dtype, torch.float32)
        own = summary(k.to(wide), v.to(wide), i_pre.to(wide), log_f.to(wide), None if reset is None else reset[:, None])
        own = own._replace(clean=None if own.clean is None else own.clean.to(wide))
        shapes = [None if t is None else t.shape for t in own]

        def unflatten(flat):
            parts, at = [], 0
            for shape in shapes:
                if shape is None:
                    parts.append(None)
                    continue
                n = math.prod(shape)
                parts.append(flat[at:at + n].view(shape))
                at += n
            return Summary(*parts[:4], None if parts[4] is None else parts[4] > 0.5, parts[5])
        flat = torch.cat([t.reshape(-1) for t in own if t is not None])
        entering = _Entering.apply(cp, unflatten, flat, *(t.to(wide) for t in state))
    h, new = chunkwise(q, k, v, i_pre, log_f, reset, entering, cell.chunk_size)
    return read_out(h.transpose(1, 2), o, cell.norm_weight, cell.out_proj.weight, linear), new


def split_windows(model, cp: ContextGroup) -> None:
    """Make `model(x, state, reset, targets)` (a RecurrentLM, before data parallelism wraps it) run this rank's
    piece of each window, its sub-layers exchanging their states with the group's other ranks."""
    for index, block in model.blocks.items():
        cell = block.cell
        if isinstance(cell, _MinRNN):
            cell.forward = partial(_scan_piece, cell, cp)
        elif isinstance(cell, MLSTM):
            cell.forward = partial(_mlstm_piece, cell, cp)
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
