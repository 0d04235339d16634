"""What long gradients buy: a recall task whose answer lies D tokens back (issue 47).

Each sequence is a key, its value, D distractor tokens, then the key again; the model must give the value (chance:
1 / the number of values). Two ways of training the same model for the same minutes: windows of 64 tokens with the
state carried without a gradient (truncated BPTT: the answer's gradient cannot reach the pair), and exact BPTT over
the whole sequence in chunks of 64 (train.bptt_chunk: rpt/parallel/bptt.py). The loss is the answer's alone;
accuracy is on fresh sequences.

    .venv/bin/python benchmarks/recall.py [--cells lstm,mingru] [--distances 512,2048] [--minutes 10]
        [--curriculum] [--only windows|exact]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KEYS, VALUES, NOISE = 16, 8, 16  # token ids: keys, then values, then distractors


def batch(rows: int, distance: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [rows, distance + 3], the values to recall [rows])."""
    key = torch.randint(0, KEYS, (rows,), generator=g)
    value = torch.randint(0, VALUES, (rows,), generator=g)
    noise = KEYS + VALUES + torch.randint(0, NOISE, (rows, distance), generator=g)
    return torch.cat([key[:, None], KEYS + value[:, None], noise, key[:, None]], 1), KEYS + value


def answer_nats(model, x: torch.Tensor, value: torch.Tensor, window: int, exact: bool) -> torch.Tensor:
    """The answer's loss at the last position: exact BPTT over everything, or the last window's gradient alone."""
    targets = torch.zeros_like(x)
    targets[:, -1] = value
    if exact or x.shape[1] <= window:  # (a sequence within one window has its whole gradient either way)
        nats, _ = model(x, targets=targets)
        return nats[:, -1]
    cut = x.shape[1] - window
    with torch.no_grad():
        _, state = model(x[:, :cut], targets=targets[:, :cut])  # the state carried, no gradient
    nats, _ = model(x[:, cut:], state, targets=targets[:, cut:])
    return nats[:, -1]


def accuracy(model, distance: int, g: torch.Generator, rows: int = 512) -> float:
    x, value = batch(rows, distance, g)
    with torch.no_grad():
        logits, _ = model(x)
    return float((logits[:, -1].argmax(-1) == value).float().mean())


def train(cell: str, distance: int, exact: bool, minutes: float, window: int = 64, curriculum: bool = False) -> dict:
    """`curriculum`: the distance doubles from 32 every 250 steps up to `distance` (accuracy always at `distance`)."""
    from rpt.config import ModelConfig
    from rpt.models.lm import RecurrentLM
    from rpt.parallel.bptt import chunk_windows

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, n_layers=1, d_model=64, vocab_size=KEYS + VALUES + NOISE,
                                    dropout=0.0, mlp_ratio=0))
    if exact:
        chunk_windows(model, window)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g, held = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    began, steps, best = time.perf_counter(), 0, 0.0
    while time.perf_counter() - began < 60 * minutes:
        now = min(distance, 32 * 2 ** (steps // 250)) if curriculum else distance
        x, value = batch(32, now, g)
        loss = answer_nats(model, x, value, window, exact).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % 50 == 0:
            best = max(best, accuracy(model, distance, torch.Generator().manual_seed(3)))
    return {"steps": steps, "accuracy": accuracy(model, distance, held), "best_probe": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="lstm,mingru")
    p.add_argument("--distances", default="512,2048")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--curriculum", action="store_true", help="train at distances doubling from 32")
    p.add_argument("--only", choices=["windows", "exact"], help="one of the two trainings")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"commit {commit.strip()}; chance {1 / VALUES:.3f}; {args.minutes:g} min of training each", flush=True)
    print("| cell | D | training | steps | accuracy |\n|---|---|---|---|---|", flush=True)
    for cell in args.cells.split(","):
        for distance in map(int, args.distances.split(",")):
            for exact in [m == "exact" for m in ([args.only] if args.only else ["windows", "exact"])]:
                r = train(cell, distance, exact, args.minutes, curriculum=args.curriculum)
                how = "exact BPTT, chunks of 64" if exact else "windows of 64, state carried"
                print(f"| {cell} | {distance:,} | {how} | {r['steps']:,} | {r['accuracy']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
