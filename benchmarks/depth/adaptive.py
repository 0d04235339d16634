"""Adaptive depth per token against fixed depth, and the shared state against the exact one (issue 46's targets).

On a trained looped run (e.g. `benchmarks/depth/curve.py --out DIR` leaves DIR/looped): held-out bits per byte in
the step form (one token at a time, as generation runs, the state carried and reset at each document) over the
first `--tokens` of the validation split in `--rows` parallel streams; and tokens/s of one row, one token at a
time, as generation runs (greedy head, every exit rule's own work), over held-out text (`--speed-tokens` of it:
the same text for every variant, since a two-level head costs more on a rarer token), and in greedy generation
after a short prompt (each variant's own text). Variants: fixed depth (loop_mean and the cap, 4 x loop_mean),
each exit rule with the cap as its most, and the shared state.

    .venv/bin/python benchmarks/depth/adaptive.py --run /tmp/depth-curve/looped [--tokens 12288] [--rows 64]
        [--exits kl:5e-4,shortlist:5e-4,change:0.01,change:0.03]
"""

from __future__ import annotations

import argparse
import sys
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
import harness
from harness import generation_speed

ROOT = Path(__file__).resolve().parents[2]


@torch.no_grad()
def stepwise_bpb(model, tokens: np.ndarray, lengths: torch.Tensor, eot: int | None, rows: int, depth: int,
                 exit=None, shared: bool = False) -> float:
    """Bits per byte of `tokens` read one token at a time in `rows` contiguous streams."""
    from rpt.ops.loop.spec import keep

    n = (len(tokens) - 1) // rows
    x = torch.from_numpy(tokens[:rows * n + 1].astype(np.int64))
    streams = torch.stack([x[r * n:(r + 1) * n + 1] for r in range(rows)])
    state, fresh, nats, nbytes = None, model.init_state(rows), 0.0, 0.0
    for t in range(n):
        token, target = streams[:, t], streams[:, t + 1]
        if state is not None and eot is not None:  # a new document: its state starts afresh, as evaluation does
            state = keep(token != eot, state, fresh)
        logits, state = model.step(token, state, depth, exit, shared)
        nats += float(-logits.float().log_softmax(-1).gather(1, target[:, None]).sum())
        nbytes += float(lengths[target].sum())
    return nats / nbytes / math.log(2)


@torch.no_grad()
def step_speed(model, tokens: np.ndarray, depth: int, exit=None, shared: bool = False) -> float:
    """Tokens/s of one row reading `tokens` one at a time, with the greedy head generation uses."""
    from rpt import kernels
    from rpt.kernels.cpu.products import generating
    from rpt.models.decoder import Decoder

    decoder = Decoder.on(model, kernels.current())

    def steps():
        state = None
        for t in torch.from_numpy(tokens.astype(np.int64)):
            h, state = model.step_hidden(t[None], state, depth, exit, shared)
            yield int(decoder.greedy(h)[0])

    stream = steps() if decoder.products is None else generating(model, steps(), decoder.products)
    next(stream)
    began = time.perf_counter()
    count = sum(1 for _ in stream)
    return count / (time.perf_counter() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--tokens", type=int, default=12288)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--speed-tokens", type=int, default=600)
    p.add_argument("--exits", default="kl:5e-4,shortlist:5e-4,change:0.01,change:0.03")
    args = p.parse_args()
    from rpt.data.mixture import open_dataset
    from rpt.data.tokenizer import token_byte_lengths
    from rpt.models.loop_exit import Exit
    from rpt.train.run_dir import load_run

    commit = harness.commit()
    cfg, model, tokenizer, _, _ = load_run(args.run, "latest", "cpu")
    data = open_dataset(cfg.data)
    tokens = data.tokens("val")[:args.tokens + 1]
    lengths = torch.from_numpy(token_byte_lengths(tokenizer).astype(np.int64))
    eot = data.eot_id if cfg.data.reset_at_documents else None
    mean, cap = round(cfg.model.loop_mean), 4 * round(cfg.model.loop_mean)
    print(f"commit {commit}; run {args.run} ({cfg.model.cell}, d {cfg.model.d_model}, loop_mean {mean}); "
          f"{len(tokens) - 1:,} held-out tokens in {args.rows} streams, one token at a time", flush=True)
    variants = [("fixed depth 1 (what no exit rule can beat)", 1, None, False),
                (f"fixed depth {mean}", mean, None, False), (f"fixed depth {cap}", cap, None, False),
                (f"shared state, depth {mean}", mean, None, True), (f"shared state, depth {cap}", cap, None, True)]
    variants += [(f"exit {text}, at most {cap}", cap, text, False) for text in args.exits.split(",")]
    results = {}
    for name, depth, text, shared in variants:
        rule = Exit.parse(text) if text else None
        bpb = stepwise_bpb(model, tokens, lengths, eot, args.rows, depth, rule, shared)
        mean_depth = rule.mean_depth if rule else depth
        speed = step_speed(model, tokens[:args.speed_tokens], depth, Exit.parse(text) if text else None, shared)
        speed_rule = Exit.parse(text) if text else None
        generated = generation_speed(model, depth=depth, exit=speed_rule, shared=shared)
        results[name] = dict(bpb=bpb, mean_depth=mean_depth, tokens_per_s=speed, generation_tokens_per_s=generated,
                             generation_depth=speed_rule.mean_depth if speed_rule else depth)
        print(f"{name}: bpb {bpb:.4f}, mean depth {mean_depth:.2f}; {speed:.0f} tokens/s on held-out text; "
              f"generation {generated:.0f} tokens/s (mean depth {results[name]['generation_depth']:.2f})", flush=True)
    base = results[f"fixed depth {cap}"]
    print(f"\n| variant | held-out bpb (step form) | vs fixed {cap} | mean iterations | tokens/s, held-out text | "
          f"x fixed {cap} | greedy generation tokens/s |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['bpb']:.4f} | {r['bpb'] - base['bpb']:+.4f} | {r['mean_depth']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
              f"{r['generation_tokens_per_s']:.0f} |")
    for name, r in results.items():
        if name.startswith("exit"):
            ok = r["tokens_per_s"] >= 1.5 * base["tokens_per_s"] and r["bpb"] <= base["bpb"] + 0.01
            print(f"- {name}: >= 1.5x the tokens/s (held-out text) of fixed {cap} at <= +0.01 bpb: "
                  f"{'met' if ok else 'NOT met'}")
    Path(args.run, "adaptive_depth.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
