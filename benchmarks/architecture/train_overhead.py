"""Benchmark: tokens/s of rpt's Trainer against a minimal hand-written loop (issue 4 target: >= 0.95).

Same model, batch, optimiser, clipping and state carry; the minimal loop reads the same token
memmap with plain slicing and does nothing else. The two alternate, `--rounds` times each, in one
process; the ratio of their best rounds and the median of the per-round ratios are printed
(these machines are noisy).

    .venv/bin/python benchmarks/architecture/train_overhead.py --data data/shakespeare-512 [--steps 300] [--rounds 3]
        [--device cuda] [--set model.d_model=1024 --set train.precision=bf16 ...]

On a GPU the minimal loop never synchronises with the host, so the ratio also prices every
host round trip the trainer makes per step.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rpt.config import Config
from rpt.data.dataset import PreparedData
from rpt.models import RecurrentLM
from rpt.models.state import detach_state
from rpt.parallel.launch import Dist
from rpt.runtime.memory import keep_freed_memory
from rpt.train.trainer import Trainer


def minimal_loop(cfg: Config, steps: int, device: torch.device) -> float:
    torch.manual_seed(0)
    data = PreparedData(cfg.data.path)
    tokens = data.tokens("train")
    model = RecurrentLM(cfg.model).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=False)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    stream = (len(tokens) - 1) // B
    starts = np.arange(B)[:, None] * stream + np.arange(T + 1)
    state = None
    t = time.perf_counter()
    for k in range(steps):
        chunk = torch.from_numpy(tokens[starts + (k * T) % (stream - T - 1)].astype(np.int64)).to(device)
        with autocast:
            logits, state = model(chunk[:, :-1], state)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        state = detach_state(state)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * B * T / (time.perf_counter() - t)


def rpt_loop(cfg: list[str], steps: int, device: torch.device) -> float:
    """`cfg`: the overrides the run is loaded with."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(Config.load(None, [*cfg, f"train.max_steps={steps}"]), Path(tmp), Dist(0, 1, 0, device),
                          show_progress=False)
        return trainer.run()["tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/shakespeare-512")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], help="a config override for both loops")
    args = ap.parse_args()
    device = torch.device(args.device)
    keep_freed_memory()
    overrides = [f"data.path={args.data}", "model.cell=lstm", "model.d_model=256", "model.n_layers=2",
                 "train.batch_size=16", "train.seq_len=64", "train.eval_interval=0", "train.warmup_steps=0",
                 "train.schedule=constant", "monitor.log_interval=50", "data.reset_at_documents=false", *args.set]
    minimal, ours = [], []
    vocab = f"model.vocab_size={PreparedData(args.data).vocab_size}"
    minimal_loop(Config.load(None, [*overrides, vocab]), 10, device)  # a short round of each first: kernels,
    rpt_loop(overrides, 10, device)                                    # cuDNN plans, allocator pools
    for _ in range(args.rounds):
        minimal.append(minimal_loop(Config.load(None, [*overrides, vocab]), args.steps, device))
        ours.append(rpt_loop(overrides, args.steps, device))
        print(f"minimal {minimal[-1]:,.0f} tokens/s   rpt {ours[-1]:,.0f} tokens/s")
    ratios = sorted(o / m for o, m in zip(ours, minimal))
    print(f"best rounds: minimal {max(minimal):,.0f}, rpt {max(ours):,.0f}, ratio {max(ours) / max(minimal):.3f}; "
          f"median of per-round ratios {ratios[len(ratios) // 2]:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
