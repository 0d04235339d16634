"""Every benchmark script (and tool) runs from its place: `--help` exits 0 and prints its usage (the scripts that
only run on a GPU or need root included: their --help needs neither), and benchmarks/quality/scaling.py's arithmetic on
known points. The fast scripts run for real in their own tests (tests/test_benchmark_peers.py,
tests/kernels/test_triton_compiles.py)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
LIBRARIES = {"benchmarks/comm/netns.py", "benchmarks/harness.py"}  # imported by the scripts, not run
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for folder in (BENCHMARKS, REPO / "tools") for p in folder.rglob("*.py")
                 if "__pycache__" not in p.parts and p.relative_to(REPO).as_posix() not in LIBRARIES)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_answers_help(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the tests' own: triton_compile.py
    # refuses it, since it compiles the kernels)
    done = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def load_scaling():
    spec = importlib.util.spec_from_file_location("scaling", BENCHMARKS / "quality" / "scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flops_to_reach_a_loss_interpolate_log_flops_between_the_bracketing_points():
    scaling = load_scaling()
    points = [{"train_flops": 1e14, "bpb": 1.4}, {"train_flops": 4e14, "bpb": 1.2}, {"train_flops": 1.6e15, "bpb": 1.1}]
    assert scaling.flops_to_reach(points, 1.3) == pytest.approx(2e14)  # half way in log FLOPs
    assert scaling.flops_to_reach(points, 1.2) == pytest.approx(4e14)
    assert scaling.flops_to_reach(points, 1.05) is None  # never reached
    assert scaling.flops_to_reach(points, 1.5) == pytest.approx(1e14)  # reached at the first point already
    assert math.isclose(scaling.mean([1.0, 2.0]), 1.5)
