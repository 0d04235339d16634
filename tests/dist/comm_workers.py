"""What each rank runs in the communication tests (importable by spawned workers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def base_overrides(data: str) -> list[str]:
    return [f"data.path={data}", "model.d_model=32", "model.n_layers=2", "model.dropout=0.1", "train.batch_size=4",
            "train.seq_len=16", "train.max_steps=6", "train.warmup_steps=2", "train.eval_interval=0",
            "train.eval_tokens=1024", "monitor.log_interval=1", "comm.bucket_mb=0.005"]


def train_variants(data: str, out_dir: str, variants: list[tuple[str, list[str]]]) -> dict:
    """Train each (name, overrides) in turn in this process group; return what the tests compare."""
    from rpt.config import Config
    from rpt.parallel import launch
    from rpt.train.trainer import Trainer

    d = launch.setup("cpu")
    torch.set_num_threads(1)
    results = {}
    try:
        for name, overrides in variants:
            cfg = Config.load(None, base_overrides(data) + overrides)
            run_dir = Path(out_dir) / name
            trainer = Trainer(cfg, run_dir, d, show_progress=False)
            summary = trainer.run()
            opt = trainer.runner.optimizer
            optim_numel = sum(t.numel() for st in (opt.state.values() if opt else ()) for t in st.values()
                              if torch.is_tensor(t) and t.dim() > 0)
            losses = {}
            if d.rank == 0:
                for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                    record = json.loads(line)
                    if record["kind"] == "train":
                        losses[record["step"]] = record
            results[name] = {"summary": summary, "optim_numel": optim_numel, "losses": losses,
                             "params": {n: p.detach().clone() for n, p in trainer.runner.model.named_parameters()},
                             "owned": sum(p.numel() for p in trainer.runner.owned)}
    finally:
        launch.teardown()
    return results


def build_auto_with_timings(timed: dict) -> dict:
    """comm.mode = auto with the pattern timings replaced by `timed`: which sync it built, what this rank owns."""
    import dataclasses

    from rpt.comm.modes import build_sync, choose_mode
    from rpt.config import CommConfig
    from rpt.comm import links
    from rpt.parallel import launch

    d = launch.setup("cpu")
    try:
        links.time_modes = lambda grad_bytes, **_: dict(timed)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        cfg = CommConfig(mode="auto", bucket_mb=0.0005)
        grad_bytes = sum(4 * p.numel() for p in model.parameters())
        mode, codec, choice = choose_mode(grad_bytes, cfg, "fp32")  # what resolving a run does with "auto"
        cfg = dataclasses.replace(cfg, mode=mode, compression=codec)
        sync = build_sync(model, cfg, rank=d.rank, world_size=d.world_size, distributed=True, predictions=choice)
        return {"mode": sync.mode, "owned": sum(p.numel() for p in sync.owned),
                "total": sum(p.numel() for p in model.parameters()), "compression": cfg.compression,
                "wire": str(getattr(sync, "wire_dtype", None)),
                "hooks": [type(h).__name__ for h in getattr(sync, "hooks", [])]}
    finally:
        launch.teardown()


def powersgd_overlap(blocking: bool, steps: int) -> dict:
    """PowerSGD over several DDP buckets on gloo for `steps` steps: how many layers' gradients backward computed
    while some bucket's round was under way, and the final parameters. `blocking`: each round
    waited for inside the hook, as before the worker thread (the reference the results must equal). Otherwise
    every round is held, on its worker thread, until backward has computed the first layer's gradient (the last it
    computes): `gates_opened` counts the rounds that saw it within a minute, which only rounds that backward does
    not wait for can (were backward to wait for a round, the round would wait for backward: none would open)."""
    import threading
    import time

    import torch.distributed as dist
    from rpt.comm import compress
    from rpt.comm.modes import AllReduceSync
    from rpt.config import CommConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        last_gradient, gates = threading.Event(), []
        if blocking:
            def waited(state, bucket):
                fut = compress._powersgd_round(state, bucket)
                fut.wait()
                return fut
            compress.powersgd_hook = waited
        else:
            round_of = compress._powersgd_round

            def gated(state, bucket, start=None):
                gates.append(last_gradient.wait(timeout=60))
                return round_of(state, bucket, start)
            compress._powersgd_round = gated
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        sync = AllReduceSync(model, CommConfig(compression="powersgd", powersgd_rank=2, bucket_mb=0.3),
                             dist.get_world_size(), powersgd_start=2, seed=0, example=lambda m: torch.zeros(1, 256))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ready = []  # when each weight's gradient was computed
        for layer in model:
            layer.weight.register_post_accumulate_grad_hook(lambda p: ready.append(time.perf_counter()))
        model[0].weight.register_post_accumulate_grad_hook(lambda p: last_gradient.set())
        overlapped = []
        for step in range(steps):
            x = torch.randn(512, 256, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            last_gradient.clear()
            gates.clear()
            sync.module(x).pow(2).mean().backward()
            sync.wait_gradients()
            intervals = list(sync.meter.intervals)
            record = sync.meter.end_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 2:  # PowerSGD proper (plain all-reduce before start_powerSGD_iter)
                overlapped.append({"buckets": len(intervals), "hidden": record["hidden_comm_fraction"],
                                   "computed_during_a_round": sum(any(a < t < b for a, b in intervals) for t in ready),
                                   "gates_opened": sum(gates)})
            ready.clear()
        return {"overlapped": overlapped, "params": [p.detach().clone() for p in model.parameters()]}
    finally:
        dist.destroy_process_group()
