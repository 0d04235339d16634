"""Gated DeltaNet: flash-linear-attention's kernel (rpt/ops/gdn/library.py) against rpt's chunkwise form in the
same process, on a GPU: agreement (outputs, final state, gradients) and forward + backward time, at 4 heads of
128, windows of 2,048, bf16 inputs, with resets inside the windows (issue 71's GPU check; benchmarks/gpu_check.sh
runs it). On a machine without CUDA or without fla-core it says so and exits 0.

    python benchmarks/cells/gdn_library.py [--rows 8] [--length 2048] [--heads 4] [--dim 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import timed
from rpt.ops.gdn import library
from rpt.ops.gdn.chunkwise import chunkwise


def inputs(B, H, T, d, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q = F.normalize(torch.randn(B, H, T, d, device=device, generator=g), dim=-1) * d ** -0.5
    k = F.normalize(torch.randn(B, H, T, d, device=device, generator=g), dim=-1)
    v = torch.randn(B, H, T, d, device=device, generator=g)
    decay = -F.softplus(torch.randn(B, H, T, device=device, generator=g) - 2)
    beta = torch.sigmoid(torch.randn(B, H, T, device=device, generator=g))
    S = torch.randn(B, H, d, d, device=device, generator=g) * 0.1
    reset = torch.zeros(B, T, dtype=torch.bool, device=device)
    reset[:, T // 3] = True  # a document starting inside every row
    reset[0, 0] = True
    return [x.to(dtype) for x in (q, k, v)] + [decay, beta.to(dtype)], reset, S


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    run = library.kernel()
    if not torch.cuda.is_available() or run is None:
        print(f"no comparison: cuda {torch.cuda.is_available()}, fla-core {'installed' if run else 'not installed'}")
        return
    device = torch.device("cuda")
    xs, reset, S = inputs(args.rows, args.heads, args.length, args.dim, device, torch.bfloat16)
    forms = {"rpt chunkwise": lambda *a: chunkwise(*a, chunk=64), "fla": lambda *a: library.by_sequences(run, *a)}
    got = {}
    for name, form in forms.items():
        leaves = [x.clone().requires_grad_() for x in (*xs, S)]
        o, final = form(*leaves[:5], reset, leaves[5])
        (o.float().square().mean() + final.float().square().mean()).backward()
        got[name] = (o.float(), final.float(), [x.grad.float() for x in leaves])

        def step():
            ls = [x.detach().requires_grad_() for x in (*xs, S)]
            o, final = form(*ls[:5], reset, ls[5])
            (o.float().square().mean() + final.float().square().mean()).backward()
        seconds = timed(step, device, args.repeats)
        tokens = args.rows * args.length
        print(f"| {name} | {args.rows} x {args.length}, {args.heads} heads of {args.dim}, bf16 | {seconds * 1e3:.2f} ms "
              f"forward + backward | {tokens / seconds:,.0f} tokens/s |")
    (o0, s0, g0), (o1, s1, g1) = got["rpt chunkwise"], got["fla"]

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))
    print(f"agreement (relative norm of the difference, fla against rpt): outputs {rel(o1, o0):.2e}, final state "
          f"{rel(s1, s0):.2e}, gradients " + ", ".join(f"{n} {rel(a, b):.2e}" for n, a, b in
                                                     zip(["q", "k", "v", "g", "beta", "S"], g1, g0)))


if __name__ == "__main__":
    main()
