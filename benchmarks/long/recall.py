"""What long gradients buy: a recall task whose answer lies D tokens back (issue 47).

Each sequence is a key, its value, D distractor tokens, then the key again; the model must give the value (chance:
1 / the number of values). Two ways of training the same model for the same minutes: windows of 64 tokens with the
state carried without a gradient (truncated BPTT: the answer's gradient cannot reach the pair), and exact BPTT over
the whole sequence in chunks of 64 (train.bptt_chunk: rpt/parallel/bptt.py). The loss is the answer's alone;
accuracy is on fresh sequences.

    .venv/bin/python benchmarks/long/recall.py [--cells lstm,mingru] [--distances 512,2048] [--minutes 10]
        [--curriculum] [--only windows|exact] [--forget-bias B] [--lr 3e-3] [--d-model 64] [--layers 1]
        [--like-values] [--stop-at ACCURACY] [--start D0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KEYS, VALUES, NOISE = 16, 8, 16  # token ids: keys, then values, then distractors


def batch(rows: int, distance: int, g: torch.Generator, like_values: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [rows, distance + 3], the values to recall [rows]). `like_values`: the distractors are value tokens
    too, so only the key says which one to keep (the write itself must be learned)."""
    key = torch.randint(0, KEYS, (rows,), generator=g)
    value = torch.randint(0, VALUES, (rows,), generator=g)
    noise = (KEYS if like_values else KEYS + VALUES) + torch.randint(0, VALUES if like_values else NOISE,
                                                                    (rows, distance), generator=g)
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


def accuracy(model, distance: int, g: torch.Generator, rows: int = 512, like_values: bool = False) -> float:
    x, value = batch(rows, distance, g, like_values)
    with torch.no_grad():
        logits, _ = model(x)
    return float((logits[:, -1].argmax(-1) == value).float().mean())


def remember_longer(model, bias: float) -> None:
    """Start the cell's carry near 1: a = sigmoid(bias) (lstm: model.forget_bias; minGRU: the update gate's bias at
    -bias; minLSTM: forget at +bias, input at -bias), so that a gradient survives hundreds of steps at the start."""
    from rpt.models.cells.minrnn import MinGRU, MinLSTM

    for block in model.blocks.values():
        cell, H = block.cell, block.cell.d_hidden
        with torch.no_grad():
            if isinstance(cell, MinGRU):
                cell.in_proj.bias[:H] = -bias
            elif isinstance(cell, MinLSTM):
                cell.in_proj.bias[:H], cell.in_proj.bias[H:2 * H] = bias, -bias


def train(cell: str, distance: int, exact: bool, minutes: float, window: int = 64, curriculum: bool = False,
          forget_bias: float | None = None, lr: float = 3e-3, d_model: int = 64, like_values: bool = False,
          layers: int = 1, stop_at: float = 0.0, start: int = 0) -> dict:
    """`curriculum`: the distance doubles from 32 every 250 steps up to `distance` (accuracy always at `distance`);
    `start`: train at this distance first, doubling it each time the accuracy there reaches 0.9 (a window of 64
    never sees a whole sequence when it is above 61);
    `forget_bias`: the carry's starting bias (remember_longer), else each cell's own."""
    from rpt.config import ModelConfig
    from rpt.models.lm import RecurrentLM
    from rpt.parallel.bptt import chunk_windows

    torch.manual_seed(0)
    options = {"forget_bias": forget_bias} if forget_bias is not None and cell in ("lstm", "modlstm") else {}
    model = RecurrentLM(ModelConfig(cell=cell, n_layers=layers, d_model=d_model, vocab_size=KEYS + VALUES + NOISE,
                                    dropout=0.0, mlp_ratio=0, **options))
    if forget_bias is not None:
        remember_longer(model, forget_bias)
    if exact:
        chunk_windows(model, window)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g, held = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    began, steps = time.perf_counter(), 0
    now = min(distance, start) if start else distance  # the distance trained at
    while time.perf_counter() - began < 60 * minutes:
        now = min(distance, 32 * 2 ** (steps // 250)) if curriculum else now
        x, value = batch(32, now, g, like_values)
        loss = answer_nats(model, x, value, window, exact).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % 50 == 0:
            probe = accuracy(model, distance, torch.Generator().manual_seed(3), max(64, 512 * 512 // distance),
                             like_values)  # fewer rows at long distances: the probe costs no more than at 512
            if stop_at and probe >= stop_at:  # learned: the held-out accuracy below says how well
                break
            if start and now < distance and accuracy(model, now, torch.Generator().manual_seed(4), 256,
                                                     like_values) >= 0.9:
                now = min(distance, 2 * now)  # learned at this distance: twice as far
            if steps % 200 == 0:  # the way there, on stderr
                print(f"  step {steps}: D {now}, loss {loss.item():.3f}, accuracy at {distance} {probe:.3f}",
                      file=sys.stderr, flush=True)
    return {"steps": steps, "accuracy": accuracy(model, distance, held, like_values=like_values),
            "minutes": (time.perf_counter() - began) / 60}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="lstm,mingru")
    p.add_argument("--distances", default="512,2048")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--curriculum", action="store_true", help="train at distances doubling from 32")
    p.add_argument("--only", choices=["windows", "exact"], help="one of the two trainings")
    p.add_argument("--forget-bias", type=float, help="start each cell's carry at sigmoid(this) (remember_longer)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--stop-at", type=float, default=0.0, help="end a training once its probe accuracy reaches this")
    p.add_argument("--start", type=int, default=0,
                   help="train at this distance first, doubling it once learned (accuracy 0.9 there)")
    p.add_argument("--like-values", action="store_true", help="distractors drawn from the value tokens")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"commit {commit.strip()}; chance {1 / VALUES:.3f}; {args.minutes:g} min of training each", flush=True)
    print("| cell | D | training | steps | minutes | accuracy |\n|---|---|---|---|---|---|", flush=True)
    for cell in args.cells.split(","):
        for distance in map(int, args.distances.split(",")):
            for exact in [m == "exact" for m in ([args.only] if args.only else ["windows", "exact"])]:
                r = train(cell, distance, exact, args.minutes, curriculum=args.curriculum,
                          forget_bias=args.forget_bias, lr=args.lr, d_model=args.d_model,
                          like_values=args.like_values, layers=args.layers, stop_at=args.stop_at,
                          start=args.start)
                how = "exact BPTT, chunks of 64" if exact else "windows of 64, state carried"
                print(f"| {cell} | {distance:,} | {how} | {r['steps']:,} | {r['minutes']:.1f} | {r['accuracy']:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
