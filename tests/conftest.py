"""Shared fixtures: the real text the tests read, and small prepared datasets built from it."""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

# Triton's kernels run through its interpreter here (tests/ops: their Triton forms): triton reads the flag once, so
# it is set before anything imports triton; a GPU run of the model tests (RPT_TEST_DEVICE=cuda) compiles them.
if os.environ.get("RPT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rpt.config import Config  # noqa: E402
from rpt.parallel.launch import Dist  # noqa: E402
from rpt.train.resolve import check  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker a core: one thread each, children included
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
SIBLING = str(REPO.parent / "shared") + os.sep  # the peers' folder beside a build machine's checkout


def _no_sibling_folder(event: str, args: tuple) -> None:
    """A user's clone has no ../shared, so no test may read it: any file opened there (in this process; the suite's
    subprocesses were traced once, benchmarks/results/training.md) fails the test that opens it."""
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and \
            os.path.abspath(os.fspath(args[0])).startswith(SIBLING):
        raise RuntimeError(f"a test opened {args[0]}: tests read only the repository (tests/corpus holds their text)")


sys.addaudithook(_no_sibling_folder)

# the matrix-product peak MFU is measured against (rpt/runtime/peak.py), measured once per test process beside the
# suite's other work: kept out of the machine's own cache, which a real run's MFU reads
if "RPT_PEAK_CACHE" not in os.environ:
    import tempfile

    os.environ["RPT_PEAK_CACHE"] = str(Path(tempfile.mkdtemp(prefix="rpt-peak-")) / "peak_flops.json")


@pytest.fixture(autouse=True)
def test_device():
    """`RPT_TEST_DEVICE=cuda pytest tests/models tests/ops/mlstm` runs the model and op tests on a GPU
    (benchmarks/gpu_check.sh does): every tensor and module a test makes without naming a device lands on the
    default device, so the same parity checks (fast path against reference, float64 where the path allows) cover
    cuDNN and the CUDA paths without a second copy of the tests. Unset (CI, the CPU): nothing changes."""
    device = os.environ.get("RPT_TEST_DEVICE", "cpu")
    if device == "cpu":
        yield torch.device("cpu")
        return
    torch.set_default_device(device)
    try:
        yield torch.device(device)
    finally:
        torch.set_default_device("cpu")


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """Real text the repository carries (tests/corpus/README.md): tiny-shakespeare, unpacked once a session."""
    import gzip

    path = tmp_path_factory.mktemp("shakespeare") / "input.txt"
    path.write_bytes(gzip.decompress((REPO / "tests" / "corpus" / "tinyshakespeare.txt.gz").read_bytes()))
    return path


@pytest.fixture(scope="session")
def shakespeare_text(shakespeare) -> str:
    return shakespeare.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, shakespeare_text) -> Path:
    """Real text as 60 documents of varied size, some with non-ASCII and undecodable bytes."""
    root = tmp_path_factory.mktemp("corpus")
    speeches = shakespeare_text.split("\n\n")
    for i in range(60):
        text = "\n\n".join(speeches[i * 40:(i + 1) * 40])
        if i % 7 == 0:
            text += "\nÆsop said: «naïve café» — ΑΒΓ 漢字 🙂\n"
        data = text.encode("utf-8")
        if i % 11 == 0:
            data += b"\xff\xfe broken \xc3\n"
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_bytes(data)
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, small_corpus) -> Path:
    """The small corpus prepared with a 300-token vocabulary (hash split, about 10% validation: every run's final
    evaluation reads the whole split, and the suite runs hundreds)."""
    from rpt.data.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(PrepareOptions(out=out, inputs=[str(small_corpus)], vocab_size=300, val_fraction=0.1, progress=False))
    return out


@pytest.fixture
def make_cfg(tiny_data):
    def make(*overrides: str) -> Config:
        base = [f"data.path={tiny_data}", "model.d_model=32", "model.n_layers=2", "train.batch_size=4",
                "train.seq_len=16", "train.max_steps=6", "train.warmup_steps=2", "train.eval_interval=0",
                "train.eval_tokens=2048", "monitor.log_interval=1", "monitor.tensorboard=false"]
        cfg = Config.load(None, base + list(overrides))
        check(cfg)  # what spans sections, as every command checks it on loading (rpt.cli.load_config)
        return cfg
    return make


@pytest.fixture
def solo() -> Dist:
    """One process on the CPU: no process group."""
    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def cut_and_resumed(make_cfg, tmp_path, solo):
    """`run(*overrides) -> (full, resumed)`: a run of 6 steps, and the same run cut at its step-3 checkpoint and
    resumed (not yet run on: its trainer at step 3)."""
    from rpt.train.trainer import Trainer

    def run(*overrides: str):
        given = (*overrides, "checkpoint.interval=3")
        full = Trainer(make_cfg(*given, "train.max_steps=6"), tmp_path / "full", solo, show_progress=False)
        full.run()
        Trainer(make_cfg(*given, "train.max_steps=3"), tmp_path / "cut", solo, show_progress=False).run()
        resumed = Trainer(make_cfg(*given, "train.max_steps=6"), tmp_path / "cut", solo, resume=True,
                          show_progress=False)
        assert resumed.progress.step == 3
        return full, resumed
    return run


class Ran(typing.NamedTuple):
    """What a command gave: as subprocess.CompletedProcess names it, and unpacked (status, stdout, stderr)."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """`cli(*args)`: `rpt ARGS` through its entry point in this process (a command a test runs after a training:
    a process of its own would spend most of the test importing torch)."""
    from rpt.cli import main

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exit:
            code = exit.code
        out, err = capsys.readouterr()
        return Ran(code, out, err)
    return run
