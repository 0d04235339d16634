"""Builds rpt's C++ time loops (the sources beside this file) once per machine and loads them.

Why our own C++: at small batch each step of the recurrent loops is one small matrix product and 6-10 small
elementwise ops, and from Python each op costs several times its dispatch from C++; torch.compile would unroll
the T steps of the loop (and TorchScript is deprecated), and no library offers these cells' loops (figures:
benchmarks/results/cells.md). Each recurrence's C++ lives in its folder of rpt/ops, listed here: modlstm_cpu.cpp
and gru_cpu.cpp are the Python loops of their loops.py step for step on the same buffers (each step's elementwise
part one pass of the same arithmetic on the CPU: CELL_steps.h, on step_passes.h's vector helpers; at few rows the
whole loop in one parallel region: `threaded_loops.h`), minrnn_cpu.cpp minGRU's and minLSTM's linear recurrence
in one pass each way; beside this file, what they share: the per-step product (`project.h`, and for few rows
`small_batch_product.cpp`); and the allocator of exact BPTT in chunks and of FSDP (rpt/runtime/page_pool.cpp).
They build into one library whose operators are torch.ops.rpt_loops.

It is built with torch's JIT extension builder (g++ and ninja) into ~/.cache/rpt/native/ (RPT_NATIVE_DIR
overrides), one folder per torch version, source and compile flags, by one process at a time (the others wait
for it), and loaded from there afterwards without asking ninja again (`built.json` marks a finished build). Every
process runs the checks registered with `on_load` once before any cell relies on the loops; where they cannot be
built (no compiler) or fail a check, the Python loops run, after one warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

OPS = Path(__file__).parents[2] / "ops"  # the recurrences' own C++ (rpt/ops/CELL/CELL_cpu.cpp, CELL_steps.h)
RUNTIME = Path(__file__).parents[2] / "runtime"  # its allocator, the page pool (rpt/runtime/page_pool.cpp)
SOURCES = [Path(__file__).with_name("small_batch_product.cpp"), RUNTIME / "page_pool.cpp"] + \
    [OPS / cell / f"{cell}_cpu.cpp" for cell in ("modlstm", "gru", "minrnn")]
HEADERS = [Path(__file__).with_name(name) for name in ("project.h", "step_passes.h", "threaded_loops.h")] + \
    [OPS / cell / f"{cell}_steps.h" for cell in ("modlstm", "gru")]  # in the build's key
NAME = "rpt_recurrent_loops"
STAMP = "built.json"  # written once the loops of a build folder have been built and loaded: then they only load
CHECKS: list = []  # run once on the loaded loops before any cell uses them (on_load)


def on_load(check) -> None:
    """Register `check(ops)`, run once per process on the freshly loaded loops; an exception there means the loops
    are not used (rpt.models.cells registers one that runs every cell that uses them, both ways)."""
    CHECKS.append(check)


def compile_flags() -> list[str]:
    """-O3; AVX2 with FMA where this CPU has them (the vector type of ATen's headers then uses them); OpenMP where
    torch runs its threads on it (Linux): without -fopenmp, ATen's header-only at::parallel_for runs its whole range
    on the calling thread, and min_scan's and small_batch_product's splits across threads ran on one (the OpenMP
    runtime is torch's own libgomp, already loaded). Not with a clang named in CXX, which needs libomp's headers
    to accept -fopenmp: a failed build would cost the loops, where the flag only costs their threads. The flags are
    part of the build folder's name: a cache shared by machines of different CPUs keeps one build for each."""
    flags = ["-O3"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    gcc = "clang" not in Path(os.environ.get("CXX", "c++")).name
    if sys.platform.startswith("linux") and gcc and "OpenMP" in torch.__config__.parallel_info():
        flags += ["-fopenmp"]
    return flags


def build_directory() -> Path:
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    digest = hashlib.sha256(sources + " ".join(compile_flags()).encode()).hexdigest()[:12]
    root = Path(os.environ.get("RPT_NATIVE_DIR") or Path.home() / ".cache" / "rpt" / "native")
    return root / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"


_built = {}  # "ops": what this process's one build gave (a plain dict, which torch.compile's tracing reads as is)


def built_loops():
    """torch.ops.rpt_loops, or None (with a warning saying why) where it cannot be built; once per process."""
    if "ops" not in _built:
        _built["ops"] = _compile_and_load()
    return _built["ops"]


def _compile_and_load():
    out = build_directory()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if shutil.which("ninja") is None:  # the ninja wheel's binary: beside the interpreter, or in the package
            os.environ["PATH"] = os.pathsep.join([_ninja_bin_dir(), os.environ.get("PATH", "")])
        # One process builds at a time (the ranks of a job start together); the others wait for its build and
        # load it. The kernel drops this lock when its holder dies; torch's own lock file would then stay behind
        # and make every later build wait forever, so whoever holds this lock clears it.
        with open(out / "build.flock", "w") as held:
            waiting = threading.Timer(1.0, lambda: print(f"rpt: waiting for another process that builds the "
                                                         f"native recurrent loops into {out}", file=sys.stderr,
                                                         flush=True))
            waiting.start()  # said only where the wait is a build's, not another process loading the loops
            try:
                fcntl.flock(held, fcntl.LOCK_EX)
            finally:
                waiting.cancel()
            (out / "lock").unlink(missing_ok=True)
            library = out / f"{NAME}.so"
            if (out / STAMP).is_file() and library.is_file():
                # built and loaded before, by this checkout or another: ninja is not asked, since another
                # checkout's command line (its own include paths) would make it build the same loops again
                torch.ops.load_library(str(library))
            else:
                _build(out)
                (out / STAMP).write_text(json.dumps({"torch": torch.__version__, "flags": compile_flags(),
                                                     "built_by": sys.executable, "time": time.time()}))
        _register_shapes()
        _self_test(torch.ops.rpt_loops)
        return torch.ops.rpt_loops
    except Exception as e:  # no compiler, no ninja, a failed build: the Python loops are the same computation
        warnings.warn(f"rpt: the native recurrent loops could not be built ({type(e).__name__}: {str(e)[:300]}); "
                      "modlstm, gru, mingru and minlstm run their Python loops (slower). Install g++ and ninja to "
                      "build them.", stacklevel=3)
        return None


def _build(out: Path) -> None:
    """Compile and load the loops with torch's extension builder, saying so (it takes ~25 s once)."""
    from torch.utils import cpp_extension

    sources = _copy_sources(out / "src")
    say = lambda: print(f"rpt: compiling the native recurrent loops into {out} (once, ~25 s)",  # noqa: E731
                        file=sys.stderr, flush=True)
    # ninja decides whether anything is rebuilt: say so at once for a new folder, and after a moment otherwise
    # (a finished build of an earlier rpt, without the stamp, loads in well under a second)
    notice = threading.Timer(0.0 if not (out / f"{NAME}.so").exists() else 1.5, say)
    notice.start()
    try:
        cpp_extension.load(NAME, sources, extra_cflags=compile_flags(), build_directory=str(out),
                           is_python_module=False, verbose=False)
    finally:
        notice.cancel()


def _copy_sources(folder: Path) -> list[str]:
    """The sources, copied into the build folder: every checkout of one version then gives ninja the same paths,
    so that a cache shared by two checkouts keeps one build instead of each rebuilding it for the other."""
    folder.mkdir(exist_ok=True)
    for source in SOURCES + HEADERS:
        copy = folder / source.name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)
    return [str(folder / source.name) for source in SOURCES]


def _register_shapes() -> None:
    """Output shapes of the min scan ops, for torch.compile: tracing runs ops on tensors without data, and an op
    without such a rule stops it (`torch.compile` of a mingru or minlstm model failed on the CPU)."""
    def scan_forward(gates, u, h0, keep, kind):
        return u.new_empty(u.shape[0], u.shape[1], h0.shape[1])

    def scan_backward(grad_h, gates, u, h, h0, keep, kind):
        return [torch.empty_like(u), torch.empty_like(h0)]

    torch.library.register_fake("rpt_loops::min_scan_forward")(scan_forward)
    torch.library.register_fake("rpt_loops::min_scan_backward")(scan_backward)


def _self_test(ops) -> None:
    """Run the registered checks on `ops` before any cell relies on them: the C++ calls oneDNN's operators by
    schema, so a torch whose schemas differ fails here, at load, and not in a training step.

    On a thread of its own: the first use of the loops may come inside a caller's autograd context, such as a
    block's forward under activation checkpointing, whose saved-tensor hooks (like grad mode and autocast) belong
    to the caller's thread. Run there, a check's tensors went to the checkpoint, which then failed it and the run."""
    failures = []

    def run_checks():
        try:
            for check in CHECKS:
                check(ops)
        except BaseException as e:  # noqa: BLE001 (raised again on the caller's thread)
            failures.append(e)

    with torch.random.fork_rng(devices=[]):  # the CPU generator is the process's
        thread = threading.Thread(target=run_checks, name="rpt-native-self-test")
        thread.start()
        thread.join()
    if failures:
        raise failures[0]


def _ninja_bin_dir() -> str:
    try:
        import ninja

        if ninja.BIN_DIR:
            return ninja.BIN_DIR
    except (ImportError, AttributeError):
        pass
    return str(Path(sys.executable).parent)
