"""Multi-query associative recall (Zoology's MQAR task, Arora et al. 2023): many key-value pairs a sequence, then
every key asked again in a random order after a gap; the model must give each key's value (chance: 1 / VALUES).
What a matrix memory (mlstm, gdn) should do better than a vector state (lstm) of the same parameters: hold many
associations at once. recall.py holds one pair a sequence and asks about long gradients; this asks about capacity.

Each cell is trained for the same minutes at about the same parameters (its width chosen to match the reference
cell's parameter count at --d-model), on fresh sequences every step; the loss is the answers' alone; accuracy is
over every query of 512 held-out sequences.

    .venv/bin/python benchmarks/long/mqar.py [--cells lstm,mlstm,gdn] [--pairs 16] [--gap 64] [--minutes 10]
        [--d-model 64] [--layers 2] [--heads 4] [--lr 3e-3] [--keys 64] [--values 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
HEADED = ("mlstm", "gdn")  # the cells that take model.heads


def batch(rows: int, pairs: int, gap: int, keys: int, values: int, g: torch.Generator):
    """(inputs [rows, 2 pairs + gap + pairs], targets of the same shape: -100 but at the queries). Token ids: keys
    [0, keys), values [keys, keys + values), the gap's filler [keys + values, keys + 2 values): distinct keys in a
    sequence, each asked once."""
    key = torch.rand(rows, keys, generator=g).argsort(-1)[:, :pairs]
    value = keys + torch.randint(0, values, (rows, pairs), generator=g)
    filler = keys + values + torch.randint(0, values, (rows, gap), generator=g)
    order = torch.rand(rows, pairs, generator=g).argsort(-1)
    asked = key.gather(1, order)
    x = torch.cat([torch.stack([key, value], -1).flatten(1), filler, asked], 1)
    targets = torch.full_like(x, -100)
    targets[:, -pairs:] = value.gather(1, order)
    return x, targets


def build(cell: str, d_model: int, layers: int, heads: int, vocab: int):
    from rpt.config import ModelConfig
    from rpt.models.lm import RecurrentLM

    torch.manual_seed(0)
    options = {"heads": heads} if cell in HEADED else {}
    return RecurrentLM(ModelConfig(cell=cell, n_layers=layers, d_model=d_model, vocab_size=vocab, dropout=0.0,
                                   mlp_ratio=0, **options))


def recurrent_params(model) -> int:
    return sum(p.numel() for block in model.blocks.values() for p in block.cell.parameters())


def width_matching(cell: str, target: int, layers: int, heads: int, vocab: int, reference: int) -> int:
    """The width (a multiple of the heads for the headed cells) whose cells' parameters come nearest `target`."""
    step = heads if cell in HEADED else 1
    widths = range(step, 4 * reference + 1, step)
    return min(widths, key=lambda d: abs(recurrent_params(build(cell, d, layers, heads, vocab)) - target))


def accuracy(model, x, targets) -> float:
    with torch.no_grad():
        logits, _ = model(x)
    asked = targets != -100
    return float((logits.argmax(-1)[asked] == targets[asked]).float().mean())


def train(model, args, vocab: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    held = batch(512, args.pairs, args.gap, args.keys, args.values, torch.Generator().manual_seed(2))
    began, steps = time.perf_counter(), 0
    while time.perf_counter() - began < 60 * args.minutes:
        x, targets = batch(args.rows, args.pairs, args.gap, args.keys, args.values, g)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % 200 == 0:  # the way there, on stderr
            print(f"  step {steps}: loss {loss.item():.3f}, held-out accuracy {accuracy(model, *held):.3f}",
                  file=sys.stderr, flush=True)
    return {"steps": steps, "minutes": (time.perf_counter() - began) / 60, "accuracy": accuracy(model, *held)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="lstm,mlstm,gdn")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--gap", type=int, default=64, help="filler tokens between the pairs and the queries")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--d-model", type=int, default=64, help="the first cell's width; the others' match its parameters")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="mlstm's and gdn's heads")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--values", type=int, default=64)
    args = p.parse_args()
    if args.pairs > args.keys:
        p.error(f"--pairs {args.pairs} exceeds --keys {args.keys}: a sequence's keys are distinct")
    vocab = args.keys + 2 * args.values
    cells = args.cells.split(",")
    target = recurrent_params(build(cells[0], args.d_model, args.layers, args.heads, vocab))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"commit {commit.strip()}; {args.pairs} pairs, gap {args.gap}, {args.keys} keys, {args.values} values "
          f"(chance {1 / args.values:.3f}); {args.layers} layers; {args.minutes:g} min of training each; "
          f"{torch.get_num_threads()} threads", flush=True)
    print("| cell | width | recurrent params | steps | minutes | accuracy |\n|---|---|---|---|---|---|", flush=True)
    for cell in cells:
        width = args.d_model if cell == cells[0] else width_matching(cell, target, args.layers, args.heads, vocab,
                                                                       args.d_model)
        model = build(cell, width, args.layers, args.heads, vocab)
        r = train(model, args, vocab)
        print(f"| {cell} | {width} | {recurrent_params(model):,} | {r['steps']:,} | {r['minutes']:.1f} | "
              f"{r['accuracy']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
