"""What each rank runs in the context-parallel tests (importable by the fork server's workers)."""

from __future__ import annotations

import torch


def window_against_one_process(cells: list[str], cp: int, bf16: bool = False) -> dict:
    """For each cell: a model with an attention block, a window with resets inside it, in float64 (or float32
    under bf16 autocast, `bf16`). This rank runs
    its piece under context parallelism; the whole window also runs here in one piece. Returns, per cell, the
    largest differences of the losses, the state after the window and the gradients (summed over the group)."""
    import torch.distributed as dist

    from rpt.config import ModelConfig
    from rpt.models import RecurrentLM
    from rpt.models.state import map_state
    from rpt.parallel import launch
    from rpt.parallel.context import ContextGroup, split_windows

    d = launch.setup("cpu")
    torch.set_num_threads(1)
    out = {}
    try:
        group = ContextGroup(cp, d.rank, d.world_size)
        for cell in cells:
            cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=3, cell=cell, attention_every=2,
                              attention_window=4, attention_heads=2, mlp_ratio=2.0)
            torch.manual_seed(0)
            dtype = torch.float32 if bf16 else torch.float64
            ref = RecurrentLM(cfg).to(dtype)
            torch.manual_seed(0)
            model = RecurrentLM(cfg).to(dtype)
            split_windows(model, group)
            g = torch.Generator().manual_seed(1)
            B, T = 2, 8 * cp
            x = torch.randint(0, 50, (B, T), generator=g)
            y = torch.randint(0, 50, (B, T), generator=g)
            reset = torch.zeros(B, T, dtype=torch.bool)
            reset[0, 3], reset[1, T // cp] = True, True  # inside a piece, and at a piece's first token
            state = map_state(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), ref.init_state(B))
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
            with autocast:
                nats_ref, state_ref = ref(x, state, reset, y)
            nats_ref.sum().backward()
            with autocast:
                nats, new = model(x, state, reset, y)
            nats.sum().backward()
            grads = {}
            for name, p in model.named_parameters():
                grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                grads[name] = grad
            piece = slice(group.rank * T // cp, (group.rank + 1) * T // cp)
            with torch.no_grad(), autocast:
                whole, _ = model(x, state, reset, y)
            diff = lambda a, b: float((a - b).abs().max())
            out[cell] = {
                "nats": diff(nats, nats_ref[:, piece]),
                # relative to each tensor's scale where above 1 (mlstm's memory is a sum of k v^T: not O(1))
                "state": max(diff(a, b) / max(1.0, float(b.abs().max())) for a, b in zip(_flat(new), _flat(state_ref))),
                "grads": max(diff(grads[n], p.grad) for n, p in ref.named_parameters()),
                "grad_scale": max(float(p.grad.abs().max()) for p in ref.parameters()),
                "eval": diff(whole, nats_ref) if whole is not None else None,
            }
    finally:
        launch.teardown()
    return out


def _flat(state) -> list[torch.Tensor]:
    from rpt.models.state import map_state

    found = []
    map_state(lambda t: found.append(t) or t, state)
    return found
