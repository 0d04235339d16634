"""The head-wise modlstm, lstm and gru on rpt's Triton loops against cuDNN's nn.LSTM: forward + backward tokens/s, bf16.

    python benchmarks/triton_cells.py                 # on a GPU
    TRITON_INTERPRET=1 python benchmarks/triton_cells.py --quick   # the script itself, on the CPU interpreter

For each cell, hidden size and head count, one layer (d_model = hidden) at B x T: rpt's cell with `heads` (its
block-diagonal recurrence in rpt/kernels/triton/, a program per head), nn.LSTM of the same hidden size (dense:
k times the recurrent parameters), and nn.LSTM of equal parameters (the hidden size whose dense LSTM has as many).
Each row: median of --repeats timed forward + backward passes after two warm-ups.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from rpt.config import ModelConfig
from rpt.models.block import build_cell


def timed(fn, device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


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
    ap.add_argument("--cells", default="modlstm,lstm,gru")
    args = ap.parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    shapes = [(32, 2, 3, 4)] if args.quick else [
        (hidden, heads, B, T) for hidden, heads in ((1024, 16), (1024, 32), (768, 16), (768, 48))
        for B, T in ((16, 1024), (64, 256))]
    print("| cell | hidden | heads | B x T | rpt tokens/s | nn.LSTM same hidden | ratio | nn.LSTM equal params "
          "(hidden) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell_name in args.cells.split(","):
        for hidden, heads, B, T in shapes:
            row(cell_name, hidden, heads, B, T, device, args)


def row(cell_name: str, hidden: int, heads: int, B: int, T: int, device, args) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, T, hidden, device=device, requires_grad=True)
    cell = build_cell(ModelConfig(cell=cell_name, d_model=hidden, heads=heads)).to(device)
    if args.quick:  # the CPU takes the dense path: call the Triton loop itself
        from rpt.kernels.triton.gru import gru_sequence
        from rpt.kernels.triton.lstm import lstm_sequence
        from rpt.kernels.triton.modlstm import modlstm_sequence

        state = cell.init_state(B, device)

        def ours():
            if cell_name == "lstm":
                y = lstm_sequence(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, *state, None, heads)[0]
            elif cell_name == "gru":
                y = gru_sequence(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, *state, None, heads)[0]
            else:
                y = modlstm_sequence(x, cell.w_x, cell.w_h, cell.bias, None, None, None, state, None, cell.gate,
                                     False, heads)[0]
            y.sum().backward()
    else:
        ours = fwd_bwd(cell, x)
        with torch.no_grad():  # fp32: the Triton loop (tf32 products) against the reference loop
            error = (cell(x[:2, :64])[0] - cell.reference(x[:2, :64])[0]).abs().max().item()
        print(f"{cell_name} hidden {hidden} heads {heads}: max |y - reference| {error:.2e} (fp32 in, tf32 products)")
    t_ours = timed(ours, device, args.repeats)
    same = torch.nn.LSTM(hidden, hidden, batch_first=True).to(device)
    params = sum(p.numel() for p in cell.parameters())
    h_eq = equal_params_hidden(hidden, params)
    equal = torch.nn.LSTM(hidden, h_eq, batch_first=True).to(device)
    t_same, t_equal = (timed(fwd_bwd(m, x), device, args.repeats) for m in (same, equal))
    tok = B * T
    print(f"| {cell_name} | {hidden} | {heads} | {B} x {T} | {tok / t_ours:,.0f} | {tok / t_same:,.0f} | "
          f"{t_same / t_ours:.2f} | {tok / t_equal:,.0f} ({h_eq}) | {t_equal / t_ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
