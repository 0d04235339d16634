"""Depth recurrence over a stack of blocks, in plain torch: the one definition of the loop, which rpt's DepthLoop
(rpt/models/loop.py) runs and `rpt export` ships beside modeling_rpt.py. It imports torch alone.

    x = prelude(x);  e = inject_norm(x);  h = h0(e)
    depth times:  h = state_norm(core(inject(h, e)))
    x = coda(h)

`state` holds the prelude blocks' states, then one slot per iteration of the core blocks' states, then the coda's.
An iteration beyond the slots held starts from the deepest slot's state; after the run, a slot this call did not
reach takes the state of the deepest iteration it ran. At inference a call may end a row's iterations early
(adaptive depth, `stop`) or keep one slot for all iterations (`shared`).
"""

import torch


def run_loop(run_block, blocks, x, state, depth, prelude, core, inject, state_norm, inject_norm, h0, backprop=None,
             watch=None, stop=None, shared=False):
    """`run_block(block, x, s) -> (x, s)` runs one block; the first depth - `backprop` iterations run without
    gradients (None: none do); `watch.add(i, h, previous)` and `watch.finish(h)`, if given, see the state.
    `stop(i, h, previous) -> [B] bool`, if given, names the rows whose iterations end after iteration i (at most
    `depth`): a row that stopped keeps its state, and its later slots take its last iteration's state; the call
    returns once every row has stopped. `shared`: every slot takes the last iteration's state, so that each
    iteration of the next call starts from this call's last (one slot's memory, not `depth`).
    Returns (x, the new state)."""
    n_coda = len(blocks) - prelude - core
    new = []
    for block, s in zip(blocks[:prelude], state[:prelude]):
        x, s = run_block(block, x, s)
        new.append(s)
    held = state[prelude:len(state) - n_coda]
    slots = [held[i:i + core] for i in range(0, len(held), core)]
    slots += [slots[-1]] * (depth - len(slots))  # iterations never run yet: the deepest state there is
    e = inject_norm(x)
    h = h0(e)
    grad, running, last = torch.is_grad_enabled(), None, depth - 1  # running: the rows still iterating
    for i in range(depth):
        with torch.set_grad_enabled(grad and (backprop is None or i >= depth - backprop)):
            u, slot = inject(h, e), []
            for block, s in zip(blocks[prelude:prelude + core], slots[i]):
                u, s = run_block(block, u, s)
                slot.append(s)
            u = state_norm(u)
        if running is not None:  # rows that stopped keep their last iteration's state
            u, slot = keep(running, u, h), keep(running, slot, slots[i - 1])
        h, previous, slots[i] = u, h, slot
        if watch is not None:
            watch.add(i, h, previous)
        if stop is not None:
            ended = stop(i, h, previous)
            if bool(ended.any()):  # (rows keep their states only once one has stopped)
                running = ~ended if running is None else running & ~ended
                if not bool(running.any()):
                    last = i
                    break
    if watch is not None:
        watch.finish(h)
    slots[last + 1:] = [slots[last]] * (len(slots) - last - 1)  # not reached this time: the deepest reached
    if shared:
        slots[:] = [slots[last]] * len(slots)
    new += [s for slot in slots for s in slot]
    x = h
    for block, s in zip(blocks[prelude + core:], state[len(state) - n_coda:]):
        x, s = run_block(block, x, s)
        new.append(s)
    return x, new


def keep(running, new, old):
    """`new` in the rows still running, `old` in the others: [B, ...] tensors, or lists and tuples of them."""
    if isinstance(new, torch.Tensor):
        return torch.where(running.view(-1, *[1] * (new.dim() - 1)), new, old)
    return type(new)(keep(running, n, o) for n, o in zip(new, old))
