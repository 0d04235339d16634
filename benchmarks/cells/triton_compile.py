"""Every Triton kernel of rpt compiled for an H200 (sm_90) on this machine, no GPU needed: what each variant needs
of a streaming multiprocessor (registers, stack where registers spill, shared memory) at each warp count.

    python benchmarks/cells/triton_compile.py            # every variant; the autotuned loops at 2, 4 and 8 warps
    python benchmarks/cells/triton_compile.py --quick    # one or two variants of each kernel at 4 warps (a test runs it)
    pip install --no-deps --target /tmp/t36 triton==3.6.0 && PYTHONPATH=/tmp/t36 python benchmarks/cells/triton_compile.py
                                                   # with the GPU machine's triton

Triton's interpreter, which the tests run the kernels through, accepts programs the compiler refuses (types that
differ between branches, shapes a layout cannot hold) and says nothing of registers; this compiles them as a GPU
would, with Triton's own ptxas, and reads the cubins' resource use with its cuobjdump. Each variant's launch is
recorded by running the cells' host code on the CPU with the kernels replaced by recorders (the shapes, dtypes
and constants a GPU run passes), then compiled. Run it without TRITON_INTERPRET (the kernels must be compiled
ones).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run this without TRITON_INTERPRET=1: it compiles the kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rpt import kernels  # noqa: E402
from rpt.config import ModelConfig  # noqa: E402
from rpt.ops.gru import triton as gru  # noqa: E402
from rpt.ops.lstm import triton as lstm  # noqa: E402
from rpt.ops.minrnn import triton as min_scan  # noqa: E402
from rpt.ops.modlstm import triton as modlstm  # noqa: E402
from rpt.ops.modlstm import triton_steps as modlstm_steps  # noqa: E402
from rpt.kernels import Form  # noqa: E402
from rpt.models.lm import build_cell  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
KERNELS = {lstm: ("lstm_forward_kernel", "lstm_backward_kernel"), gru: ("gru_forward_kernel", "gru_backward_kernel"),
           modlstm: ("modlstm_forward_kernel", "modlstm_backward_kernel"),
           modlstm_steps: ("modlstm_step_kernel", "modlstm_step_backward_kernel"),
           min_scan: ("min_scan_forward_kernel", "min_scan_backward_kernel")}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def record(drive) -> list[tuple]:
    """Run `drive()` with every kernel replaced by a recorder: the launches it made, as (kernel, args, kwargs)."""
    launches, saved = [], {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for module, names in KERNELS.items():
        for name in names:
            saved[module, name] = getattr(module, name)
            setattr(module, name, Recorder(saved[module, name]))
    try:
        drive()
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
    return launches


def source(kernel, args, kwargs) -> tuple[ASTSource, str, bool]:
    """The kernel's source for one recorded launch, a name for it, and whether it is autotuned."""
    tuned = isinstance(kernel, triton.runtime.Autotuner)
    fn = kernel.fn if tuned else kernel
    signature, constants = {}, {}
    for name, value in zip(fn.arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
        else:
            signature[name] = "fp32"
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constants[name] = value
    shown = {k: getattr(v, "__name__", v) for k, v in constants.items() if k not in ("PRECISION",)}
    return ASTSource(fn, signature, constexprs=constants), f"{fn.__name__} {shown}", tuned


def resources(compiled) -> dict:
    """Registers per thread and stack bytes per thread (where registers spill), from the cubin; shared memory per
    program (Triton allocates it dynamically: its metadata)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    used = {k: int(re.search(rf"{k}:(\d+)", text).group(1)) for k in ("REG", "STACK")}
    return {**used, "SHARED": compiled.metadata.shared}


def head_wise(cell: str, D: int, heads: int, **options):
    """The head-wise loop of `cell` (d_model = D * heads), forward and backward, bf16 products as under autocast."""
    def drive():
        torch.manual_seed(0)
        H, B, T = D * heads, 16, 8
        module = build_cell(ModelConfig(cell=cell, d_model=H, heads=heads, **options))
        x = torch.randn(B, T, H, requires_grad=True)
        state = module.init_state(B)
        keep = torch.ones(T, B)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if cell == "lstm":
                y = lstm.lstm_triton_loop(x, module.w_ih, module.w_hh, module.b_ih, module.b_hh, *state, keep, heads)[0]
            elif cell == "gru":
                y = gru.gru_triton_loop(x, module.w_ih, module.w_hh, module.b_ih, module.b_hh, *state, keep, heads)[0]
            else:
                y = modlstm.modlstm_triton_loop(x, module.w_x, module.w_h, module.bias, module.ln_weight,
                                             module.ln_bias, module.peep, state, keep, module.gate, module.coupled,
                                             heads)[0]
        y.float().sum().backward()
    return drive


def stepped(H: int, **options):
    """The wide modlstm's step kernels (float32, as the cell runs them), forward and backward."""
    def drive():
        with kernels.use(force=Form.TRITON_STEPS):
            module = build_cell(ModelConfig(cell="modlstm", d_model=H, **options))
            reset = torch.zeros(16, 3, dtype=torch.bool)
            reset[0, 1] = True
            module(torch.randn(16, 3, H, requires_grad=True), None, reset)[0].sum().backward()
    return drive


def scan(kind: int, H: int):
    """minGRU's or minLSTM's scan on bf16 u, forward and backward."""
    def drive():
        u = torch.randn(16, 20, (kind + 2) * H).bfloat16().requires_grad_()
        keep = torch.ones(16, 20)
        min_scan.min_scan(u, torch.zeros(16, H), keep, kind).sum().backward()
    return drive


def variants(quick: bool) -> list:
    if quick:
        return [head_wise("lstm", 64, 2), head_wise("gru", 64, 2), head_wise("modlstm", 64, 2),
                head_wise("modlstm", 64, 1, gate="exp", gate_norm=True), stepped(256),
                stepped(96, gate="exp", gate_norm=True, heads=2), scan(min_scan.MINGRU, 128),
                scan(min_scan.MINLSTM, 128)]
    return [*(head_wise(cell, D, 2) for cell in ("lstm", "gru", "modlstm") for D in (64, 48, 16)),
            head_wise("modlstm", 64, 2, gate="hard_sigmoid", peepholes=True),
            head_wise("modlstm", 64, 2, coupled_gates=True, peepholes=True), head_wise("modlstm", 64, 2, gate="exp"),
            head_wise("modlstm", 64, 1, gate_norm=True, peepholes=True),
            head_wise("modlstm", 64, 1, gate="exp", gate_norm=True),
            stepped(1024), stepped(1024, gate="exp", gate_norm=True), stepped(1024, coupled_gates=True, peepholes=True),
            stepped(1024, gate="hard_sigmoid", gate_norm=True, heads=8), scan(min_scan.MINGRU, 2048),
            scan(min_scan.MINLSTM, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one or two variants of each kernel, 4 warps")
    args = ap.parse_args()
    kernels.current().loops()  # the native loops' build checks run cells: before any kernel is replaced
    seen, failed = set(), 0
    print("| kernel and constants | warps | registers / thread | stack bytes / thread (spills) | shared bytes | "
          "compile s |")
    print("|---|---|---|---|---|---|")
    for drive in variants(args.quick):
        for kernel, launch_args, kwargs in record(drive):
            src, name, tuned = source(kernel, launch_args, kwargs)
            if name in seen:
                continue
            seen.add(name)
            for warps in ((2, 4, 8) if tuned and not args.quick else (4,)):
                began = time.perf_counter()
                try:
                    used = resources(triton.compile(src, target=TARGET, options=dict(num_warps=warps)))
                except Exception as exc:  # noqa: BLE001  (every failure is listed; the exit code counts them)
                    failed += 1
                    print(f"| {name} | {warps} | failed: {type(exc).__name__}: {str(exc)[:400]} |", flush=True)
                    continue
                print(f"| {name} | {warps} | {used['REG']} | {used['STACK']} | {used['SHARED']:,} | "
                      f"{time.perf_counter() - began:.1f} |", flush=True)
    print(f"{len(seen)} kernel variants, {failed} compilations failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
