"""Context parallelism (parallel.cp) on real gloo processes: a window split over ranks gives the losses, the state
after it and the gradients of the whole window in one process, for every cell (with resets inside the window and an
attention block), and a run trains as one process does."""

from __future__ import annotations

import pytest

from context_workers import window_against_one_process
from ranks import run_ranks
from pipeline_workers import train_runs
from test_pipeline import assert_same_training, reference

CELLS = ["lstm", "gru", "modlstm", "mingru", "minlstm", "mlstm", "gdn"]


@pytest.mark.parametrize("cp", [2, 3])
def test_a_window_split_over_ranks_equals_one_process(tmp_path, cp):
    cells = CELLS if cp == 2 else ["lstm", "mingru", "mlstm", "gdn"]  # three ranks: a state crosses two edges
    ranks = run_ranks(window_against_one_process, cp, tmp_path, cells, cp, timeout=120)
    for rank, found in enumerate(ranks):
        for cell in cells:
            got = found[cell]
            assert got["nats"] < 1e-12 and got["state"] < 1e-12, (rank, cell, got)
            assert got["grads"] < 1e-12 * max(1.0, got["grad_scale"]), (rank, cell, got)
            if rank == 0:  # a validation's losses come back whole on the group's first rank
                assert got["eval"] < 1e-12, (cell, got)
            else:
                assert got["eval"] is None


def test_under_bf16_autocast_the_pieces_agree_with_one_process_to_its_precision(tmp_path):
    """States and their gradients cross the edges in float32 whatever dtype each side holds them in."""
    ranks = run_ranks(window_against_one_process, 2, tmp_path, CELLS, 2, True, timeout=120)
    for rank, found in enumerate(ranks):
        for cell in CELLS:
            got = found[cell]
            # the chunkwise cells' pieces reorder their sums (each rank's chunks start at its piece, and the pieces'
            # summaries are folded), where the others hand the state on as one process computes it: in one process,
            # bf16 chunks of 8 against 64 differ as much (gdn: its state by 0.018, its gradients by 3.6% of their
            # scale, chunks of 4 against 64 by 4.5%; its triangular solves amplify the inputs' rounding)
            tol = {"mlstm": 3e-2, "gdn": 1e-1}.get(cell, 1e-2)
            assert got["nats"] < 1e-2 and got["state"] < min(tol, 3e-2), (rank, cell, got)
            assert got["grads"] < tol * got["grad_scale"], (rank, cell, got)


ATTENTION = ["model.attention_every=2", "model.attention_window=8"]


def test_training_with_cp_equals_one_process(tiny_data, tmp_path):
    runs = [("lstm", ["parallel.cp=2", *ATTENTION, "train.grad_accum=2"], False),
            ("mingru", ["parallel.cp=2", "model.cell=mingru"], False)]
    ranks = run_ranks(train_runs, 2, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    for name, overrides, _ in runs:
        ref_losses, ref_params = reference(tiny_data, tmp_path, f"ref-{name}",
                                           *[o for o in overrides if not o.startswith("parallel.cp")])
        for r in ranks:
            assert_same_training({"losses": ranks[0][name]["losses"], "params": r[name]["params"]}, ref_losses,
                                 ref_params)


def test_cp_by_dp_trains_as_one_process_over_both_groups_rows(tiny_data, tmp_path):
    """Four ranks as two cp groups of two: each group reads its own rows, both ranks of a group the same ones; the
    gradients averaged over all four are one process's over both groups' rows."""
    runs = [("cpdp", ["parallel.cp=2", "model.cell=minlstm", *ATTENTION], False)]
    ranks = run_ranks(train_runs, 4, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", "train.batch_size=8", "model.cell=minlstm",
                                       *ATTENTION)
    for r in ranks:
        assert_same_training({"losses": ranks[0]["cpdp"]["losses"], "params": r["cpdp"]["params"]}, ref_losses,
                             ref_params)
