"""What each rank runs in the DiLoCo tests (importable by spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _local_step(model, optimizer, rank: int, step: int) -> None:
    """One optimiser step on data of this rank's own (the replicas move apart)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(5, 6, generator=g, dtype=next(model.parameters()).dtype)
    optimizer.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    optimizer.step()


def _gathered(model) -> list[torch.Tensor]:
    """Every rank's parameters, flat, in rank order."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def averaging_identity(steps: int) -> dict:
    """H = 1, outer lr 1, no momentum: each outer step should leave every replica at the mean of the replicas
    after their one local step."""
    from rpt.comm.diloco import DiLoCoSync
    from rpt.config import CommConfig

    dist.init_process_group("gloo")
    try:
        rank, model = dist.get_rank(), _model()
        with torch.no_grad():  # rank 0's start must reach every replica
            for p in model.parameters():
                p.add_(rank)
        sync = DiLoCoSync(model, CommConfig(mode="diloco", diloco_steps=1, diloco_outer_lr=1.0, diloco_momentum=0.0),
                          dist.get_world_size())
        optimizer = torch.optim.SGD(sync.owned, lr=0.1)
        sync.bind(optimizer)
        worst, apart = 0.0, 0.0
        for step in range(steps):
            _local_step(model, optimizer, rank, step)
            replicas = _gathered(model)
            apart = max(apart, float((replicas[0] - replicas[-1]).abs().max()))
            mean = torch.stack(replicas).mean(0)
            sync.share_parameters()
            after = _gathered(model)
            assert all(torch.equal(a, after[0]) for a in after), "replicas differ after an outer step"
            worst = max(worst, float((after[0] - mean).abs().max()))
        return {"worst": worst, "apart": apart}
    finally:
        dist.destroy_process_group()


def one_rank_equals_inner(steps: int, every: int) -> dict:
    """A world of one with outer lr 1 and no momentum: the outer steps change nothing the inner AdamW did."""
    from rpt.comm.diloco import DiLoCoSync
    from rpt.config import CommConfig

    dist.init_process_group("gloo")
    try:
        alone, model = _model(), _model()
        inner_alone = torch.optim.AdamW(alone.parameters(), lr=0.01)
        sync = DiLoCoSync(model, CommConfig(mode="diloco", diloco_steps=every, diloco_outer_lr=1.0,
                                            diloco_momentum=0.0), 1)
        inner = torch.optim.AdamW(sync.owned, lr=0.01)
        sync.bind(inner)
        for step in range(steps):
            _local_step(alone, inner_alone, 0, step)
            _local_step(model, inner, 0, step)
            sync.share_parameters()
        sync.finish()
        return {"worst": max(float((a - b).abs().max()) for a, b in zip(alone.parameters(), model.parameters())),
                "moved": max(float((a - b).abs().max()) for a, b in zip(alone.parameters(), _model().parameters()))}
    finally:
        dist.destroy_process_group()


def payload(compression: str) -> dict:
    """One outer step at the wire width of `compression`: the bytes the meter counted, and how far the average
    is from the exact one."""
    from rpt.comm.diloco import DiLoCoSync
    from rpt.config import CommConfig

    dist.init_process_group("gloo")
    try:
        rank, model = dist.get_rank(), _model().float()
        sync = DiLoCoSync(model, CommConfig(mode="diloco", compression=compression, diloco_steps=1,
                                            diloco_outer_lr=1.0, diloco_momentum=0.0), dist.get_world_size())
        optimizer = torch.optim.SGD(sync.owned, lr=0.1)
        sync.bind(optimizer)
        _local_step(model, optimizer, rank, 0)
        start = torch.cat([p.detach().reshape(-1) for p in _model().float().parameters()])
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        mean = torch.stack(_gathered(model)).mean(0)
        sync.share_parameters()
        record = sync.meter.end_step()
        return {"bytes": record["comm_bytes"], "error": float((_gathered(model)[0] - mean).abs().max()),
                "numel": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters())),
                "change": float((mine - start).abs().max())}
    finally:
        dist.destroy_process_group()
