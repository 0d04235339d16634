"""Depth recurrence over a stack of blocks, in plain torch: the one definition of the loop, which rpt's DepthLoop
(rpt/models/loop.py) runs and `rpt export` ships beside modeling_rpt.py. It imports torch alone.

    x = prelude(x);  e = inject_norm(x);  h = h0(e)
    depth times:  h = state_norm(core(inject(h, e)))
    x = coda(h)

`state` holds the prelude blocks' states, then one slot per iteration of the core blocks' states, then the coda's.
An iteration beyond the slots held starts from the deepest slot's state; after the run, a slot this call did not
reach takes the state of the deepest iteration it ran.
"""

import torch


def run_loop(run_block, blocks, x, state, depth, prelude, core, inject, state_norm, inject_norm, h0, backprop=None,
             watch=None):
    """`run_block(block, x, s) -> (x, s)` runs one block; the first depth - `backprop` iterations run without
    gradients (None: none do); `watch.add(i, h, previous)` and `watch.finish(h)`, if given, see the state.
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
    grad = torch.is_grad_enabled()
    for i in range(depth):
        with torch.set_grad_enabled(grad and (backprop is None or i >= depth - backprop)):
            u, slot = inject(h, e), []
            for block, s in zip(blocks[prelude:prelude + core], slots[i]):
                u, s = run_block(block, u, s)
                slot.append(s)
            h, previous, slots[i] = state_norm(u), h, slot
        if watch is not None:
            watch.add(i, h, previous)
    if watch is not None:
        watch.finish(h)
    slots[depth:] = [slots[depth - 1]] * (len(slots) - depth)  # not reached this time: the deepest reached
    new += [s for slot in slots for s in slot]
    x = h
    for block, s in zip(blocks[prelude + core:], state[len(state) - n_coda:]):
        x, s = run_block(block, x, s)
        new.append(s)
    return x, new
