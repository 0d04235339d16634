"""rpt's recurrent cells on their GPU paths against cuDNN's nn.LSTM: forward + backward tokens/s, bf16 autocast.

    python benchmarks/cells/triton_speed.py                 # on a GPU
    TRITON_INTERPRET=1 python benchmarks/cells/triton_speed.py --quick   # the script itself, on the CPU interpreter

For each cell, hidden size and head count, one layer (d_model = hidden) at B x T: rpt's cell with `heads`, nn.LSTM
of the same hidden size (dense: `heads` times the recurrent parameters) and nn.LSTM of equal parameters (the hidden
size whose dense LSTM has as many). The path column says what ran rpt's cell: `kernel` (heads of 16-64 units: the
whole time loop in one Triton kernel, a program per head), `graph` (the modlstm otherwise: a cuBLAS product and one
Triton kernel a step, the loop one CUDA graph), `cuDNN` (lstm and gru otherwise; not timed, it is the peer). Each
row: median of --repeats timed forward + backward passes after two warm-ups; before the rows of a cell, its fast
path against its reference loop in fp32 (outputs and the recurrent weight's gradient, 64 steps). Last, minGRU's
and minLSTM's Triton scan against the ATen chunked scan it replaced.
"""

from __future__ import annotations

import argparse
import sys
import math

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import timed
from rpt import kernels
from rpt.config import ModelConfig
from rpt.kernels import Form
from rpt.kernels.triton import on_chip
from rpt.models.lm import build_cell
from rpt.ops.modlstm.sequence import forms as modlstm_forms


def fwd_bwd(module, x):
    def run():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
            y = module(x)[0]
        y.float().sum().backward()
    return run


def equal_params_hidden(d_in: int, params: int) -> int:
    """nn.LSTM's hidden size h whose weights, 4h(d_in + h) + 8h, are about `params`."""
    a, b = 4, 4 * d_in + 8
    return int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cells", default="modlstm,lstm,gru,mingru,minlstm")
    args = ap.parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    torch.set_float32_matmul_precision("high")  # as rpt train sets it under bf16 (rpt.train.trainer)
    shapes = [(32, 2, 3, 4), (80, 1, 3, 4)] if args.quick else [
        (hidden, heads, B, T) for hidden, head_counts in ((768, (1, 8, 16, 48)), (1024, (1, 8, 16, 64)))
        for heads in head_counts for B, T in ((16, 1024), (64, 256))]
    print("| cell | hidden | heads | path | B x T | rpt tokens/s | nn.LSTM same hidden | ratio | nn.LSTM equal params "
          "(hidden) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cell_name in args.cells.split(","):
        if cell_name in ("mingru", "minlstm"):
            continue
        checked = set()
        for hidden, heads, B, T in shapes:
            cell = build_cell(ModelConfig(cell=cell_name, d_model=hidden, heads=heads)).to(device)
            kind = path(cell, hidden, heads)
            if kind == "cuDNN":
                continue
            try:  # one failing shape does not cost the rest of a GPU lease's table
                if not args.quick and (hidden, heads) not in checked:
                    check(cell_name, cell, hidden, heads, kind, device)
                    checked.add((hidden, heads))
                row(cell_name, cell, kind, hidden, heads, B, T, device, args)
            except Exception as exc:  # noqa: BLE001
                print(f"| {cell_name} | {hidden} | {heads} | {kind} | {B} x {T} | failed: {type(exc).__name__}: "
                      f"{str(exc)[:300]} |", flush=True)
    if not args.quick:
        tuned_warps()
    scans(args, device)


def tuned_warps() -> None:
    """The warp count the autotuner chose for each loop kernel and key (rpt.kernels.triton.common.tuned)."""
    from rpt.ops.gru import triton as gru
    from rpt.ops.lstm import triton as lstm
    from rpt.ops.modlstm import triton as modlstm

    for kernel in (lstm.lstm_forward_kernel, lstm.lstm_backward_kernel, gru.gru_forward_kernel,
                   gru.gru_backward_kernel, modlstm.modlstm_forward_kernel, modlstm.modlstm_backward_kernel):
        for key, config in kernel.cache.items():
            print(f"tuned {kernel.fn.__name__} {dict(zip(kernel.keys, key))}: {config.num_warps} warps")


def scans(args, device) -> None:
    """minGRU and minLSTM (d_model 1024, d_hidden 2048) with their Triton scan against the ATen chunked scan it
    replaced (the cell's own fallback), forward + backward under bf16 autocast, and the two outputs' difference."""
    print("\n| cell | B x T | Triton scan tokens/s | ATen scan tokens/s | speed-up | max abs. difference of y |")
    print("|---|---|---|---|---|---|")
    shapes = [(32, 2, 8)] if args.quick else [(1024, 64, 256), (1024, 16, 1024)]
    for cell_name in ("mingru", "minlstm"):
        if cell_name not in args.cells.split(","):
            continue
        for d, B, T in shapes:
            torch.manual_seed(0)
            cell = build_cell(ModelConfig(cell=cell_name, d_model=d)).to(device)
            x = torch.randn(B, T, d, device=device, requires_grad=True)
            times, outputs = [], []
            for backend in (dict(force=Form.TRITON_LOOP), dict(triton=False)):
                with kernels.use(**backend):
                    times.append(timed(fwd_bwd(cell, x), device, args.repeats, warmup=2, median=True))
                    with torch.no_grad():
                        outputs.append(cell(x)[0].float())
            tok = B * T
            print(f"| {cell_name} | {B} x {T} | {tok / times[0]:,.0f} | {tok / times[1]:,.0f} | "
                  f"{times[1] / times[0]:.2f}x | {(outputs[0] - outputs[1]).abs().max().item():.1e} |", flush=True)


def path(cell, hidden: int, heads: int) -> str:
    if on_chip(hidden, heads) and (cell.name != "modlstm" or
                                   Form.TRITON_LOOP in modlstm_forms(cell.variant, hidden, heads, on_gpu=True)):
        return "kernel"
    return "graph" if cell.name == "modlstm" else "cuDNN"


def check(cell_name: str, cell, hidden: int, heads: int, kind: str, device) -> None:
    """The fast path against the reference loop on 2 x 64 tokens, fp32 (tf32 products): output and the gradient of
    the recurrent weight, as max |difference| / max |reference|."""
    torch.manual_seed(1)
    x = torch.randn(2, 64, hidden, device=device)
    w = torch.randn(2, 64, hidden, device=device)
    weight = cell.w_h if cell_name == "modlstm" else cell.w_hh
    results = []
    for form in (cell.forward, cell.reference):
        y = form(x)[0]
        results.append((y.detach(), torch.autograd.grad((y * w).sum(), weight)[0]))
    (y, g), (y_ref, g_ref) = results
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the timed rows' precision
        y_bf16 = cell(x)[0].float()
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    print(f"{cell_name} hidden {hidden} heads {heads} ({kind}): against the reference loop, "
          f"output {rel(y, y_ref):.1e}, "
          f"recurrent weight gradient {rel(g, g_ref):.1e} (relative, fp32 in, tf32 products); under bf16 autocast, "
          f"output {rel(y_bf16, y_ref):.1e}", flush=True)


def row(cell_name: str, cell, kind: str, hidden: int, heads: int, B: int, T: int, device, args) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, T, hidden, device=device, requires_grad=True)
    if args.quick and kind == "graph":  # the CPU would take its own loops: the GPU's choice, run as it is
        stepped = fwd_bwd(cell, x)

        def ours():
            with kernels.use(force=Form.TRITON_STEPS):
                stepped()
    elif args.quick:  # the CPU takes its own loops: call the Triton loop itself
        from rpt.ops.gru.triton import gru_triton_loop
        from rpt.ops.lstm.triton import lstm_triton_loop
        from rpt.ops.modlstm.triton import modlstm_triton_loop

        state = cell.init_state(B, device)

        def ours():
            if cell_name == "lstm":
                y = lstm_triton_loop(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, *state, None, heads)[0]
            elif cell_name == "gru":
                y = gru_triton_loop(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, *state, None, heads)[0]
            else:
                y = modlstm_triton_loop(x, cell.w_x, cell.w_h, cell.bias, None, None, None, state, None, cell.gate,
                                     False, heads)[0]
            y.sum().backward()
    else:
        ours = fwd_bwd(cell, x)
    t_ours = timed(ours, device, args.repeats, warmup=2, median=True)
    same = torch.nn.LSTM(hidden, hidden, batch_first=True).to(device)
    params = sum(p.numel() for p in cell.parameters())
    h_eq = equal_params_hidden(hidden, params)
    equal = torch.nn.LSTM(hidden, h_eq, batch_first=True).to(device)
    t_same, t_equal = (timed(fwd_bwd(m, x), device, args.repeats, warmup=2, median=True) for m in (same, equal))
    tok = B * T
    print(f"| {cell_name} | {hidden} | {heads} | {kind} | {B} x {T} | {tok / t_ours:,.0f} | {tok / t_same:,.0f} | "
          f"{t_same / t_ours:.2f} | {tok / t_equal:,.0f} ({h_eq}) | {t_equal / t_ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
