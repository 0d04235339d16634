"""Benchmark: every cell's fast path, forward + backward, at equal parameters per layer; and generation.

Hardware efficiency is the honest measure (issue 3): achieved FLOP/s, from `flops_per_token()`
and tokens/s, over the fp32 matmul peak measured in the same run (the best of a few GEMM shapes).
nn.LSTM with hidden 512 (2.1M parameters) is the reference; each cell's width is chosen to
match its parameter count. Two shapes: B=16 x T=256 and B=2 x T=2048. Prints markdown rows; for the
cells whose time loops run in C++ (rpt.kernels.cpu), also the speed-up over their Python loops. Rows of the
chunkwise cells with their recurrence swapped: compiled by inductor, and taken away ("mlstm-floor": its projections
alone, the bound on any form of its recurrence; its GFLOP/s still count the recurrence's products).

    .venv/bin/python benchmarks/cells/speed.py [--repeats 3] [--device cpu|cuda] [--gen-tokens 100,10000]
        [--cells lstm,mlstm] [--profile mlstm]    (--profile: where one cell's time goes, at 16 x 512)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import os
import platform
import subprocess
import time
from datetime import date

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import sync, timed
from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.lm import build_cell
from rpt import kernels
from rpt.models.decoder import Decoder
from rpt.runtime.memory import keep_freed_memory

D = 512
# (name, config overrides) at about 2.1M parameters per layer, like nn.LSTM(512, 512)
CELLS = [
    ("lstm", dict(cell="lstm")),
    ("gru", dict(cell="gru", d_hidden=576)),
    ("modlstm", dict(cell="modlstm")),
    ("modlstm-exp", dict(cell="modlstm", gate="exp")),
    ("modlstm-ln-peep", dict(cell="modlstm", gate_norm=True, peepholes=True)),
    ("mingru", dict(cell="mingru", d_hidden=1344)),
    ("minlstm", dict(cell="minlstm", d_hidden=1024)),
    # the matrix memory: 6 heads of 128 (1.97M parameters); the chunkwise form at three chunk sizes
    ("mlstm", dict(cell="mlstm", d_hidden=768, heads=6)),
    ("mlstm-chunk32", dict(cell="mlstm", d_hidden=768, heads=6, chunk_size=32)),
    ("mlstm-chunk128", dict(cell="mlstm", d_hidden=768, heads=6, chunk_size=128)),
    # Gated DeltaNet: 6 heads of 128 over 768 (1.97M parameters), chunks of 64
    ("gdn", dict(cell="gdn", d_hidden=768, heads=6)),
]
SHAPES = [(16, 256), (16, 512), (2, 2048)]


def passed_through(q, k, v, gate_a, gate_b, reset, state, chunk):
    """No recurrence at all (h = v): what is left of the cell is its projections, norm and gate (and gdn's
    convolution), the floor of any form of its recurrence at these widths."""
    return v * 1.0, state


# the chunkwise cells with their recurrence swapped (the `chunkwise` of the op folder's sequence.py): compiled by
# inductor (compiled before the timing: the compile is outside it), and taken away (the floor); name: (family, swap)
SWAPS = {"mlstm-compiled": ("mlstm", lambda form: torch.compile(form, dynamic=False)),
         "mlstm-floor": ("mlstm", lambda form: passed_through),
         "gdn-compiled": ("gdn", lambda form: torch.compile(form, dynamic=False)),
         "gdn-floor": ("gdn", lambda form: passed_through)}
CELLS += [(name, dict(CELLS)[family]) for name, (family, _) in SWAPS.items()]


@contextlib.contextmanager
def swapped(name):
    """The cell's recurrence as SWAPS has it for `name` (as it is for other names)."""
    if name not in SWAPS:
        yield
        return
    family, swap = SWAPS[name]
    module = importlib.import_module(f"rpt.ops.{family}.sequence")
    form = module.chunkwise
    module.chunkwise = swap(form)
    try:
        yield
    finally:
        module.chunkwise = form


def matmul_peak(device, repeats) -> tuple[float, str]:
    """The best fp32 GEMM rate of a few shapes, and which library gave it: torch.mm (MKL on this CPU, cuBLAS on a
    GPU) and, on the CPU, oneDNN with a packed weight, the kernels nn.LSTM's oneDNN path runs (10-16% faster than
    MKL at these shapes here: measured against MKL alone, nn.LSTM came out at 1.03-1.05 of the "peak")."""
    packed = device.type == "cpu" and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    best, by = 0.0, ""
    for m, k, n in [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512), (2048, 4096, 512)]:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        c = torch.empty(m, n, device=device)
        runs = {"mm": lambda: [torch.mm(a, b, out=c) for _ in range(5)]}
        if packed:
            w = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), m)
            runs["oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "") for _ in range(5)]
        for name, run in runs.items():
            rate = 5 * 2 * m * k * n / timed(run, device, repeats)
            if rate > best:
                best, by = rate, f"{name} {m}x{k}x{n}"
    return best, by


def fwd_bwd(module, x, grad_y, reference=False):
    """Forward, then backward from a dense output gradient, as a layer inside a model receives one (y.sum()'s
    gradient is a broadcast of ones, a stride-0 operand that slows the weight-gradient GEMMs of some cells)."""
    def run():
        y, _ = module.reference(x) if reference else module(x)
        y.backward(grad_y[:, : y.shape[1]])
    return run


def bench_cells(device, repeats, peak, peak_by, names):
    rows = []
    for B, T in SHAPES:
        x = torch.randn(B, T, D, device=device, requires_grad=True)
        torch.manual_seed(0)
        ref = torch.nn.LSTM(D, D, batch_first=True).to(device)
        ref_flops = 3 * 2 * 4 * D * (D + D)
        grad_y = torch.randn(B, T, D, device=device)
        ref_tps = B * T / timed(fwd_bwd(lambda xs: ref(xs), x, grad_y), device, repeats)
        rows.append(("nn.LSTM", B, T, sum(p.numel() for p in ref.parameters()), ref_tps, ref_tps * ref_flops, ref_tps, None,
                     None))
        for name, over in CELLS:
            if names and name not in names:
                continue
            cell = build_cell(ModelConfig(d_model=D, **over)).to(device)
            with swapped(name):
                tps = B * T / timed(fwd_bwd(cell, x, grad_y), device, repeats)
            ref_speed = loop_speed = None
            if name.startswith(("modlstm", "gru", "min")) and kernels.current().loops() is not None:  # its time loops run in C++
                with kernels.use(native=False):
                    loop_speed = B * T / timed(fwd_bwd(cell, x, grad_y), device, repeats)
            if name.startswith("modlstm"):  # its own sequential reference, on a quarter of the sequence
                xs = x[:, : T // 4].detach().requires_grad_()
                ref_speed = B * (T // 4) / timed(fwd_bwd(cell, xs, grad_y, reference=True), device, 1)
            params = sum(p.numel() for p in cell.parameters())
            rows.append((name, B, T, params, tps, tps * 3 * cell.flops_per_token(), ref_tps, ref_speed, loop_speed))
    print(f"\nmatmul peak {peak / 1e9:.0f} GFLOP/s (fp32, best of 5 GEMM shapes, this run: {peak_by})\n")
    print("| cell | B x T | params | tokens/s | GFLOP/s | efficiency | vs nn.LSTM | vs own reference | "
          "vs its Python loops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, B, T, params, tps, flops, ref_tps, ref_speed, loop_speed in rows:
        own = f"{tps / ref_speed:.1f}x" if ref_speed else ""
        loops = f"{tps / loop_speed:.2f}x" if loop_speed else ""
        print(f"| {name} | {B} x {T} | {params / 1e6:.2f}M | {tps:,.0f} | {flops / 1e9:.0f} | {flops / peak:.2f} | "
              f"{tps / ref_tps:.2f} | {own} | {loops} |")


def profile(name, device, top=12):
    """The operators one cell's forward + backward spends its time in (torch.profiler, self time)."""
    cell = build_cell(ModelConfig(d_model=D, **dict(CELLS)[name])).to(device)
    x = torch.randn(16, 512, D, device=device, requires_grad=True)
    run = fwd_bwd(cell, x, torch.randn(16, 512, D, device=device))
    run()
    with torch.profiler.profile() as prof:
        for _ in range(3):
            run()
    print(f"\nwhere {name}'s forward + backward spends its time (16 x 512, 3 runs):\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_bytes(device) -> int:
    """Process RSS on the CPU; on a GPU the device's peak allocation since the last reset."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)
    return rss_bytes()


def bench_generation(device, lengths):
    what = "peak CUDA memory growth" if device.type == "cuda" else "RSS growth"
    print(f"\n| generation | new tokens | tokens/s | state numel | {what} |")
    print("|---|---|---|---|---|")
    for cell, over in (("lstm", {}), ("mingru", {}), ("modlstm", {}), ("mlstm", dict(heads=4))):
        torch.manual_seed(0)
        cfg = ModelConfig(cell=cell, **over, vocab_size=8192, d_model=256, n_layers=4, attention_every=2, attention_window=64)
        model = RecurrentLM(cfg).to(device)
        prompt = torch.randint(0, 8192, (16,), device=device)
        for n in lengths:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            before = memory_bytes(device)
            t = time.perf_counter()
            count = sum(1 for _ in Decoder.on(model, kernels.current()).generate(prompt, n, temperature=1.0, top_k=50))
            dt = time.perf_counter() - t
            state = model(prompt[None])[1]
            numel = sum(t.numel() for block in state for part in block for t in part)
            print(f"| {cell} 4x256 + attention | {count:,} | {count / dt:,.0f} | {numel:,} | "
                  f"{(memory_bytes(device) - before) / 2**20:+.1f} MiB |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gen-tokens", default="100,10000")
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--cells", default="", help="only these cells (comma-separated names of CELLS)")
    ap.add_argument("--profile", default="", help="a cell of CELLS: where its time goes")
    args = ap.parse_args()
    device = torch.device(args.device)
    keep_freed_memory()  # as `rpt train` does: the peak and the cells are measured under the same allocator
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} {os.cpu_count()} cores"
    print(f"{date.today()} | {name} | torch {torch.__version__} | commit {commit} | threads {torch.get_num_threads()}")
    peak, peak_by = matmul_peak(device, args.repeats)
    bench_cells(device, args.repeats, peak, peak_by, set(filter(None, args.cells.split(","))))
    if args.profile:
        profile(args.profile, device)
    if not args.skip_generation:
        bench_generation(device, [int(n) for n in args.gen_tokens.split(",")])


if __name__ == "__main__":
    main()
