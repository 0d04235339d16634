"""The C++ time loops (rpt.kernels.cpu) against the Python loops they replace.

test_cells.py checks both forms against the cells' sequential references in float64. Here: they are
built wherever a compiler is; in float32 (with either per-step product: rpt's small-batch one, oneDNN's)
their outputs, final state and every gradient are as close to float64 as the Python loops'; and where
the build fails, the cells still run, on the Python loops, after a warning that says why.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models.lm import build_cell
from rpt import kernels
from rpt.kernels.cpu import build, products

VARIANTS = {
    "modlstm": dict(cell="modlstm"),
    "modlstm-hard": dict(cell="modlstm", gate="hard_sigmoid"),
    "modlstm-hard-peep": dict(cell="modlstm", gate="hard_sigmoid", peepholes=True),  # pre: inputs after peepholes
    "modlstm-coupled-peep": dict(cell="modlstm", coupled_gates=True, peepholes=True),
    "modlstm-coupled-odd": dict(cell="modlstm", coupled_gates=True, d_hidden=21),  # a part-filled last vector
    "modlstm-peep-norm": dict(cell="modlstm", peepholes=True, gate_norm=True),
    "modlstm-exp": dict(cell="modlstm", gate="exp"),
    "modlstm-exp-norm": dict(cell="modlstm", gate="exp", gate_norm=True),
    "modlstm-norm-odd": dict(cell="modlstm", gate_norm=True, d_hidden=21),
    "gru": dict(cell="gru", d_hidden=24),
    "gru-odd": dict(cell="gru", d_hidden=13),
    "mingru": dict(cell="mingru", d_hidden=40),
    "minlstm": dict(cell="minlstm", d_hidden=40),
}


def test_built_wherever_a_compiler_is():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the Python loops run")
    assert kernels.current().loops() is not None, "g++ is here but the native loops did not build (see the warning)"


def test_the_build_key_covers_every_header(tmp_path, monkeypatch):
    """The loops include headers (rpt/kernels/cpu, rpt/ops/CELL): a changed header must give a new build folder, or
    every machine would go on loading the library built from the old one; and a header left out of HEADERS would.
    (rpt/runtime's page pool builds into the same library.)"""
    folders = [Path(build.__file__).parent, build.RUNTIME, *build.OPS.iterdir()]
    assert set(build.HEADERS) == {p for folder in folders for p in folder.glob("*.h")}
    assert set(build.SOURCES) == {p for folder in folders for p in folder.glob("*.cpp")}
    header = tmp_path / "passes.h"
    header.write_text("// one")
    monkeypatch.setattr(build, "HEADERS", [header])
    before = build.build_directory()
    header.write_text("// two")
    assert build.build_directory() != before


def test_the_loops_split_work_on_torchs_threads():
    """ATen's at::parallel_for is a header template: compiled without -fopenmp it runs its whole range on the
    calling thread, and min_scan's and small_batch_product's splits across threads ran on one until compile_flags
    added the flag. Where torch runs its threads on OpenMP (Linux builds), the loops must call into it."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's threads are not OpenMP's here")
    library = build.build_directory() / f"{build.NAME}.so"
    assert b"GOMP_parallel" in library.read_bytes(), "the loops were built without OpenMP: one thread"


@pytest.mark.parametrize("product", ["small-batch", "onednn"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "aten-steps"])
@pytest.mark.parametrize("name", VARIANTS)
def test_native_loops_as_accurate_as_python_loops_in_float32(name, fused, product, monkeypatch):
    """In float32 both forms round differently (ATen's vectorised kernels fuse some multiply-adds): each is
    measured against the same computation in float64, and the native loops may not be less accurate. Both
    forms of the native steps: fused into one pass (the CPU's) and as ATen ops (what a GPU runs); and either
    per-step product of gru and modlstm: rpt's small-batch one (3 rows: a pair and a single row) and oneDNN's."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    if product == "onednn" and not products._packed_available():
        pytest.skip("torch has no oneDNN linear here")
    layouts = []  # of every per-step product the native run makes
    made = products.PackedLinear.__init__
    monkeypatch.setattr(products.PackedLinear, "__init__",
                        lambda self, *a: made(self, *a) or layouts.append(self.operand[1]))
    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=16, **VARIANTS[name]))
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.2 * torch.randn_like(p))
    B, T = 3, 33
    x = torch.randn(B, T, 16)
    state = [torch.randn(B, *shape) * 0.5 for shape in cell.state_shapes()]
    if getattr(cell, "exp", False):  # a positive normaliser, a small stabiliser
        state[2], state[3] = torch.rand(B, cell.d_hidden) + 0.5, torch.randn(B, cell.d_hidden) * 0.1
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[1, 7] = reset[0, 20] = reset[2, 0] = True  # [2, 0]: no gradient reaches row 2 of the initial state
    w = torch.randn(B, T, 16)
    with contextlib.ExitStack() as forms:
        if not fused:
            forms.enter_context(kernels.use(one_pass=False))
        if product == "onednn":
            forms.enter_context(kernels.use(small_batch=False))
        got = run(cell, x, state, reset, w)
    expected = [] if VARIANTS[name]["cell"].startswith("min") else [2 if product == "small-batch" else 1] * 2
    assert layouts == expected, "the per-step products ran in another layout than the one under test"
    with kernels.use(native=False):
        python = run(cell, x, state, reset, w)
        exact = run(copy.deepcopy(cell).double(), x.double(), [s.double() for s in state], reset, w.double())
    assert len(got) == len(python) == len(exact)
    for k, (a, b, ref) in enumerate(zip(got, python, exact)):
        scale = ref.abs().max().item()
        e_native, e_python = ((a - ref).abs().max() / scale).item(), ((b - ref).abs().max() / scale).item()
        assert e_native <= 3 * e_python + 1e-6, f"output {k} of {name}: native {e_native:.2e}, python {e_python:.2e}"
        assert e_native < 1e-4, f"output {k} of {name}: {e_native:.2e} from float64"


@pytest.mark.parametrize("name", ["mingru", "minlstm"])
def test_min_scan_splits_channels_across_threads(name):
    """rpt/ops/minrnn/minrnn_cpu.cpp gives each thread a block of channels when there are more threads than batch rows: with
    one row and 4 threads, 100 channels run as blocks of 32, 32, 32 and 4. Each block carries its own state;
    together they must equal the scan in float64 (the block edges are where an index error would show)."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=8, cell=name, d_hidden=100)).double()
    x, h0 = torch.randn(1, 21, 8, dtype=torch.float64), torch.randn(1, 100, dtype=torch.float64)
    reset = torch.zeros(1, 21, dtype=torch.bool)
    reset[0, 9] = True
    w = torch.randn(1, 21, 8, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = run(cell, x, [h0], reset, w)
    finally:
        torch.set_num_threads(threads)
    with kernels.use(native=False):
        want = run(cell, x, [h0], reset, w)
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"output {k}")


@pytest.mark.parametrize("name", ["modlstm-peep-norm", "modlstm-exp-norm", "modlstm-hard-peep", "modlstm-coupled-odd",
                                  "gru-odd"])
def test_the_loops_at_few_rows_give_the_same_numbers_on_any_thread_count(name):
    """At few rows the loops run in one parallel region (modlstm_cpu.cpp, gru_cpu.cpp): each thread takes its share of every
    step's product, of the columns of its elementwise part and of the gates of its norm, between barriers. Every
    number comes out of the same arithmetic whatever the split, so 1, 2 and 3 threads (one more than a share has
    vectors: empty and uneven shares) must agree; a missing barrier or an overlapping share would not."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=16, **VARIANTS[name]))
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, w = torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    state = [torch.randn(2, *shape) * 0.5 for shape in cell.state_shapes()]
    if getattr(cell, "exp", False):
        state[2], state[3] = torch.rand(2, cell.d_hidden) + 0.5, torch.randn(2, cell.d_hidden) * 0.1
    reset = torch.zeros(2, 40, dtype=torch.bool)
    reset[0, 0] = reset[1, 13] = True
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run(cell, x, state, reset, w))
    finally:
        torch.set_num_threads(threads)
    for n, got in zip((2, 3), results[1:]):
        for k, (a, b) in enumerate(zip(got, results[0])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"output {k} on {n} threads")


def run(cell, x, state, reset, w):
    x = x.clone().requires_grad_()
    state = [s.clone().requires_grad_() for s in state]
    y, final = cell(x, state, reset)
    loss = (y * w).sum() + sum((k + 1) * 0.1 * s.sum() for k, s in enumerate(final[:2]))
    inputs = [x, *state, *cell.parameters()]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [y, *final, *[g for g in grads if g is not None]]


def test_a_failed_build_falls_back_to_the_python_loops(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setenv("RPT_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    build._built.clear()
    try:
        with pytest.warns(UserWarning, match="could not be built.*command not found.*Python loops"):
            assert kernels.current().loops() is None
        cell = build_cell(ModelConfig(d_model=8, cell="modlstm"))
        x = torch.randn(2, 5, 8)
        y, _ = cell(x)
        y_ref, _ = cell.reference(x)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    finally:
        build._built.clear()  # the next caller builds (or loads) the real thing again


def test_loops_that_fail_their_self_test_are_not_used(monkeypatch):
    """A torch whose operator schemas differ from the C++ file's fails at load, not in a training step."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")

    def broken(ops):
        raise RuntimeError("Tried to access or call an operator with a wrong signature")

    monkeypatch.setattr(build, "_self_test", broken)
    build._built.clear()
    try:
        with pytest.warns(UserWarning, match="could not be built.*wrong signature"):
            assert kernels.current().loops() is None
    finally:
        build._built.clear()
    monkeypatch.undo()
    assert kernels.current().loops() is not None  # the real self-test passes


def test_first_use_inside_a_checkpointed_forward():
    """The loops are built and self-tested on first use, which in a fresh `rpt train` process with
    model.activation_checkpointing is a block's forward under torch.utils.checkpoint: the self-test's tensors went
    to the checkpoint's hooks, the test failed (the Python loops ran after a warning) and the step's recompute
    then saved other tensors than its forward had (CheckpointError). The self-test now runs on its own thread."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    torch.manual_seed(0)
    cell = build_cell(ModelConfig(d_model=8, cell="mingru"))
    x = torch.randn(2, 5, 8, requires_grad=True)
    y, _ = cell(x)
    plain = torch.autograd.grad(y.square().sum(), [x, *cell.parameters()])
    build._built.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "could not be built" fails the test
            y, _ = torch.utils.checkpoint.checkpoint(cell, x, use_reentrant=False)
            checkpointed = torch.autograd.grad(y.square().sum(), [x, *cell.parameters()])
        assert build._built.get("ops") is not None
    finally:
        build._built.clear()
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b)


PORTABLE_CHECK = """
import sys, torch
import rpt.models
from rpt import kernels
from rpt.kernels.cpu import build
from tests.ops.test_native_loops import portable_case_outputs
assert not any("avx" in flag.lower() for flag in build.compile_flags()), build.compile_flags()
assert kernels.current().loops() is not None, "the portable build failed"
torch.save(portable_case_outputs(), sys.argv[1])
"""


def portable_case_outputs():
    """Outputs and gradients of the cells whose steps run on ATen's vector type, odd widths included."""
    results = []
    for name in ("gru-odd", "modlstm-coupled-odd", "modlstm-exp", "modlstm-peep-norm"):
        torch.manual_seed(0)
        cell = build_cell(ModelConfig(d_model=16, **VARIANTS[name]))
        B, T = 2, 9
        x, w = torch.randn(B, T, 16), torch.randn(B, T, 16)
        state = [torch.randn(B, *shape) * 0.5 for shape in cell.state_shapes()]
        if getattr(cell, "exp", False):
            state[2], state[3] = torch.rand(B, cell.d_hidden) + 0.5, torch.randn(B, cell.d_hidden) * 0.1
        reset = torch.zeros(B, T, dtype=torch.bool)
        reset[1, 4] = True
        results.append(run(cell, x, state, reset, w))
    return results


def test_the_portable_build_computes_what_this_one_does(tmp_path):
    """Where the CPU lacks AVX2 the loops are built without it (ATen's portable vector type): forced here with
    ATEN_CPU_CAPABILITY=default, in a fresh process, its results must match this build's. The portable build goes
    where every build goes (its flags are part of its folder's name, so it is another folder than an AVX2 build's): compiled on the
    suite's first run on a machine, as the native build is, and reused after (a compile is ~60 s of the suite)."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    out = tmp_path / "portable.pt"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", PORTABLE_CHECK, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    portable, here = torch.load(out), portable_case_outputs()
    for case, (a_list, b_list) in enumerate(zip(portable, here)):
        assert len(a_list) == len(b_list)
        for k, (a, b) in enumerate(zip(a_list, b_list)):  # float32 rounding apart (FMA or not): ~1e-6 of the scale
            error = ((a - b).abs().max() / b.abs().max()).item()
            assert error < 2e-5, f"case {case}, tensor {k}: {error:.1e} of its scale"


def test_a_build_says_so_and_every_checkout_builds_the_same_paths(tmp_path, monkeypatch, capsys):
    """Whenever ninja compiles, a line on stderr says so, even where a cache folder already holds a library (seen:
    22 silent seconds when a shared cache held another checkout's build); and the sources are compiled from a
    copy inside the build folder, so two checkouts of one version give ninja the same paths and share one build."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("RPT_NATIVE_DIR", str(tmp_path))
    out = build.build_directory()
    out.mkdir(parents=True)
    (out / f"{build.NAME}.so").write_bytes(b"")  # an earlier build's library: no message up front
    seen = {}

    def slow_build(name, sources, **kwargs):  # ninja rebuilding: longer than a load of a finished build
        seen["sources"] = sources
        import time
        time.sleep(2.0)
        raise RuntimeError("stop here")
    monkeypatch.setattr(cpp_extension, "load", slow_build)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert build._compile_and_load() is None
    assert "rpt: compiling the native recurrent loops" in capsys.readouterr().err
    assert all(Path(s).parent == out / "src" for s in seen["sources"])
    assert [Path(s).name for s in seen["sources"]] == [s.name for s in build.SOURCES]
    assert all((out / "src" / h.name).read_bytes() == h.read_bytes() for h in build.HEADERS)


def _python(code: str, native_dir: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RPT_NATIVE_DIR": str(native_dir),
                                 "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env})


def test_a_finished_build_loads_without_asking_ninja_again(tmp_path):
    """A build folder that holds a finished build is loaded as it is: handed to ninja with another checkout's
    command line (its own include paths), the same loops were built again, three times within an hour."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    built = build.build_directory()
    assert (built / build.STAMP).is_file()
    shutil.copytree(built, tmp_path / built.name, ignore=shutil.ignore_patterns("*.flock"))
    (tmp_path / built.name / "build.ninja").write_text("# another checkout's command line\n")
    proc = _python("from torch.utils import cpp_extension\n"
                   "def refuse(*a, **k): raise SystemExit('ninja was asked to build')\n"
                   "cpp_extension.load = refuse\n"
                   "from rpt.kernels.cpu.build import built_loops\n"
                   "assert built_loops() is not None\n", tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "compiling" not in err, err[-2000:]


def test_processes_that_start_together_build_once_and_the_others_wait(tmp_path):
    """Two processes meet an empty build folder: one builds (here a stand-in for ninja that takes 4 s and puts
    the real library in place), the other says it waits, then loads that build; nothing is built twice."""
    if kernels.current().loops() is None:
        pytest.skip("the native loops are not built here")
    fake_build = ("import os, shutil, time\n"
                  "import torch\n"
                  "from torch.utils import cpp_extension\n"
                  "def stand_in(name, sources, build_directory, **kwargs):\n"
                  "    time.sleep(4)\n"
                  "    with open(os.environ['BUILDS'], 'a') as f: f.write('built\\n')\n"
                  "    library = os.path.join(build_directory, name + '.so')\n"
                  "    shutil.copyfile(os.environ['REAL_LIBRARY'], library)\n"
                  "    torch.ops.load_library(library)\n"
                  "cpp_extension.load = stand_in\n"
                  "from rpt.kernels.cpu.build import built_loops\n"
                  "assert built_loops() is not None\n")
    env = {"BUILDS": str(tmp_path / "builds.txt"),
           "REAL_LIBRARY": str(build.build_directory() / f"{build.NAME}.so")}
    procs = [_python(fake_build, tmp_path / "cache", **env) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert (tmp_path / "builds.txt").read_text() == "built\n"
    assert sum("waiting for another process that builds" in err for _, err in results) == 1
