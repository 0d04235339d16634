"""Resume on another world size and layout: DCP reshards the model and AdamW state, the loader continues at
its global position (rpt/data/stream.py), training goes on; the same layout resumes bit-exactly, FSDP too."""

from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from pipeline_workers import resize_runs

from rpt.data.dataset import PreparedData
from rpt.data.stream import TokenStream

THREE, SIX = ["train.max_steps=3", "checkpoint.interval=3", "train.warmup_steps=100"], ["train.warmup_steps=100"]
FSDP = ["parallel.fsdp=2"]


@pytest.fixture(scope="module")
def two_ranks(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("resize")
    runs = [("ddp", THREE, None), ("fsdp", FSDP + THREE, None), ("fsdp-whole", FSDP + SIX, None),
            ("fsdp-again", FSDP + SIX, "fsdp"), ("ddp-from-fsdp", SIX, "fsdp"), ("fsdp-from-ddp", FSDP + SIX, "ddp")]
    return out, run_ranks(resize_runs, 2, out / "ranks", str(tiny_data), str(out), runs, timeout=300)


def saved_extras(run_dir):
    return torch.load(run_dir / "checkpoints" / "step_00000003" / "extras" / "rank0.pt", weights_only=False)


def assert_resumed(got: dict, source: dict, tiny_data, source_dir, world: int, batch: int = 4) -> None:
    """What a resized resume must hold: the saved step, weights and moments whole, each rank's loader where
    the saved global position puts it, and three more finite steps."""
    loaded = got["loaded"]
    assert loaded["step"] == 3 and got["summary"]["steps"] == 6
    for name, p in source["params"].items():
        assert torch.equal(loaded["params"][name], p), name  # resharded, not changed
    assert loaded["exp_avg"] is not None and loaded["exp_avg"].abs().sum() > 0
    expected = TokenStream(PreparedData(tiny_data).tokens("train"), batch, 16, rank=got["rank"], world_size=world)
    expected.load_state_dict(saved_extras(source_dir)["loader"])
    assert loaded["loader"] == expected.state_dict()
    if got["rank"] == 0:
        assert sorted(got["losses"]) == [1, 2, 3, 4, 5, 6] and all(v == v for v in got["losses"].values())


def test_fsdp_resumes_bit_exactly_on_its_own_layout(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        again, whole = r["fsdp-again"], r["fsdp-whole"]
        assert again["losses"] == whole["losses"]
        assert all(torch.equal(again["params"][k], whole["params"][k]) for k in whole["params"])


def test_fsdp_to_ddp_and_back_on_two_ranks(two_ranks, tiny_data):
    out, ranks = two_ranks
    for rank, r in enumerate(ranks):
        for run, source in (("ddp-from-fsdp", "fsdp"), ("fsdp-from-ddp", "ddp")):
            assert_resumed({**r[run], "rank": rank}, r[source], tiny_data, out / source, world=2)
            # the same 8 streams on the same ranks: the loader continues exactly where it stopped
            assert r[run]["loaded"]["loader"]["step"] == 3 and r[run]["loaded"]["loader"]["remainder"] is None


@pytest.mark.parametrize("world, extra", [(1, []), (3, []), (4, FSDP)])
def test_a_two_rank_checkpoint_resumes_on_another_world_size(two_ranks, tiny_data, tmp_path, world, extra):
    out, ranks = two_ranks
    got = run_ranks(resize_runs, world, tmp_path / "ranks", str(tiny_data), str(out),
                    [(f"on{world}-{tmp_path.name}", extra + SIX, "ddp")], timeout=300)
    for rank, r in enumerate(got):
        run = next(iter(r.values()))
        assert_resumed({**run, "rank": rank}, ranks[0]["ddp"], tiny_data, out / "ddp", world=world)
        assert run["loaded"]["loader"]["remainder"] is not None  # 4 x world streams: the rest of the epoch
