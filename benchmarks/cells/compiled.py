"""Eager against torch.compile(fullgraph=True) for the fused recurrent kernels, forward + backward.

Why: on a GPU modlstm's fused kernel issues ~10 small kernels per time step (benchmarks/results/cells.md, the H200 run:
0.14-0.15 of cuDNN's LSTM). Its kernel is a torch custom operator, so a compiled model keeps it whole, and with
mode="reduce-overhead" torch.compile records the compiled step as CUDA graphs: a replay launches the captured
per-step kernels without the host. This measures what that gives, and checks the compiled results against eager.
On the CPU (--device cpu: a dry run of the script) it compiles with aot_eager and no graphs.

    python benchmarks/cells/compiled.py                 # on a GPU
    python benchmarks/cells/compiled.py --device cpu    # a dry run
"""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import timed
from rpt.config import ModelConfig
from rpt.models.lm import build_cell

VARIANTS = {"modlstm": dict(cell="modlstm"), "modlstm-exp": dict(cell="modlstm", gate="exp"), "gru": dict(cell="gru")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shapes = [(16, 256, 512), (2, 2048, 512)] if cuda else [(2, 32, 32)]
    print("| cell | B x T x D | eager ms | compiled ms | speed-up | max rel. difference |")
    print("|---|---|---|---|---|---|")
    for name, cfg in VARIANTS.items():
        for B, T, D in shapes:
            torch.manual_seed(0)
            cell = build_cell(ModelConfig(d_model=D, **cfg)).to(device)
            x = torch.randn(B, T, D, device=device, requires_grad=True)
            g = torch.randn(B, T, D, device=device)
            compiled = torch.compile(cell, fullgraph=True, mode="reduce-overhead" if cuda else None,
                                     backend="inductor" if cuda else "aot_eager")

            def run(c):
                if c is compiled and cuda:
                    torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten
                cell.zero_grad(set_to_none=True)
                x.grad = None
                y, _ = c(x)
                y.backward(g)
                return [y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in cell.parameters())]

            eager = run(cell)
            for _ in range(3):  # compile, record the graphs, warm up
                got = run(compiled)
            diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, eager))
            t_eager = 1e3 * timed(lambda: run(cell), device, args.repeats, warmup=0)
            t_compiled = 1e3 * timed(lambda: run(compiled), device, args.repeats, warmup=0)
            print(f"| {name} | {B} x {T} x {D} | {t_eager:.1f} | {t_compiled:.1f} | {t_eager / t_compiled:.2f}x "
                  f"| {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
