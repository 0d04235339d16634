"""`rpt scaling`: the FLOP budget a grid's points train under, the grid run as real `rpt train` processes (split
over workers, resumed, a stopped point started again), and a law fitted, saved and read back."""

import json

import numpy as np
import pytest

from rpt.errors import RptError
from rpt.runtime.version import rpt_commit
from rpt.scaling.fit import Law3, effective_tokens
from rpt.scaling.grid import Grid, Grids, open_grid
from rpt.scaling.law import Law, fit_law
from rpt.scaling.report import table
from rpt.train import recipe
from rpt.train.trainer import Trainer


def test_a_flop_budget_ends_the_run_where_its_flops_are_spent(make_cfg, tmp_path, solo):
    fpt = Trainer(make_cfg(), tmp_path / "probe", solo, show_progress=False).flops_per_token
    budget = fpt * 64 * 5  # five steps of 4 x 16 tokens
    summary = Trainer(make_cfg("train.max_steps=0", f"train.max_flops={budget}"), tmp_path / "a", solo,
                      show_progress=False).run()
    assert summary["steps"] == 5 and summary["tokens"] * summary["flops_per_token"] >= budget


def test_the_recipe_sizes_a_flop_budget_by_each_size_s_flops():
    facts = {}
    choices = recipe.choose(1000, 100, {"flops": 1e9}, {(2, 128): 1.0, (2, 256): 1.0}, 64, frozenset(), facts=facts,
                            params={(2, 128): 1000, (2, 256): 5000}, flops={(2, 128): 1e6, (2, 256): 4e6})
    chosen = {c.key: c.value for c in choices}
    # 2 x 256 would see 250 tokens, under 0.4 a parameter; 2 x 128 sees 1,000: one pass over the 1,000
    assert chosen["model.d_model"] == 128 and facts["passes"] == pytest.approx(1.0)


def test_a_grid_runs_as_workers_resumes_and_restarts_a_stopped_point(cli, tiny_data, tmp_path):
    folder = tmp_path / "grid"
    flags = ["--data", str(tiny_data), "--budgets", "3e8", "--sizes", "2x16,2x24,2x32", "--batches", "4",
             "--set", "train.seq_len=16"]
    ran = cli("scaling", "commands", str(folder), *flags)
    lines = ran.stdout.splitlines()
    assert ran.returncode == 0 and len(lines) == 3 and all("train.max_flops=3e+08" in x for x in lines)
    assert json.loads((folder / "grid.json").read_text())["blocks"][0]["sizes"] == [[2, 16], [2, 24], [2, 32]]
    other = cli("scaling", "commands", str(folder), "--data", str(tiny_data), "--budgets", "1e9", "--sizes", "2x16,2x24,2x32")
    assert other.returncode == 2 and "would not be alike" in other.stderr

    ran = cli("scaling", "run", str(folder), "--worker", "0/2")  # the saved grid: points 0 and 2
    assert ran.returncode == 0, ran.stderr
    done = sorted(p.name for p in (folder / "points").iterdir())
    assert done == ["tiny-lstm-2x16-b4-3e08", "tiny-lstm-2x32-b4-3e08"]
    for name in done:
        s = json.loads((folder / "points" / name / "summary.json").read_text())
        assert s["val_bpb"] > 0 and s["tokens"] * s["flops_per_token"] >= 3e8
        assert "train.max_flops = 3e+08" in s["ended_by"]
    left = cli("scaling", "commands", str(folder)).stdout.splitlines()
    assert len(left) == 1 and "tiny-lstm-2x24-b4-3e08" in left[0]

    stopped = folder / "points" / "tiny-lstm-2x24-b4-3e08"  # a run that stopped before its final evaluation
    stopped.mkdir()
    (stopped / "config.toml").write_text("# stopped\n")
    ran = cli("scaling", "run", str(folder), "--worker", "1/2")
    assert ran.returncode == 0, ran.stderr
    assert "kept as tiny-lstm-2x24-b4-3e08.partial" in ran.stdout and (stopped.with_name(stopped.name + ".partial")
                                                                       / "config.toml").is_file()
    assert "0 done, 1 to run" in ran.stdout and (stopped / "summary.json").is_file()
    again = cli("scaling", "run", str(folder))  # all done: nothing runs; three points fit no law (five parameters)
    assert "3 done, 0 to run" in again.stdout and again.returncode == 0 and "no law yet" in again.stderr
    assert "5 or more" in again.stderr
    grown = cli("scaling", "commands", str(folder), *flags[:2], "--budgets", "6e8", *flags[4:])  # a budget added
    assert "added 3 point(s)" in grown.stderr and sum("train.max_flops=6e+08" in x for x in grown.stdout.splitlines()) == 3
    ran = cli("scaling", "run", str(folder), "--worker", "1/2")  # two of the three new points: not every one is done
    assert ran.returncode == 0 and not (folder / "law.json").exists()
    fitted = cli("scaling", "fit", str(folder))  # the law of the five finished so far
    assert fitted.returncode == 0, fitted.stderr
    law = Law.load(folder / "law.json")
    assert law.provenance["points_fitted"] == 5 and law.provenance["budgets_fitted"] == [3e8, 6e8]
    assert law.provenance["runs_rpt_commits"] == [str(rpt_commit())]  # the runs' rpt, each from its summary
    for p in law.points:  # N: the parameters beside the embedding and head, at least the two layers' lstm matrices
        d = p["size"][1]
        summary = json.loads((folder / "points" / p["name"] / "summary.json").read_text())
        assert 2 * 8 * d * d < p["n"] <= summary["params"] - d * p["vocab"]  # (the head may share the embedding)
    assert "| 6e+08 |" in (folder / "law.md").read_text() and "law: " in fitted.stdout


def test_a_law_fitted_saved_and_read_back_chooses_the_truth_s_best_size(tiny_data, tmp_path):
    truth = Law3(0.9, 40.0, 0.35, 300.0, 0.4)
    unique = json.loads((tiny_data / "meta.json").read_text())["splits"]["train"]["tokens"] * 1000
    sizes = {(2, 64): (2e5, 8e6), (2, 128): (5e5, 1e7), (2, 256): (1e6, 1.3e7), (2, 384): (2e6, 1.9e7),
             (2, 512): (4e6, 3e7)}
    rows = []
    for c in (1e13, 3e13, 1e14):
        for size, (n, fpt) in sizes.items():
            tokens = c / fpt
            rows.append({"family": "lstm", "vocab": 300, "batch": 64, "size": list(size), "budget": c, "n": n,
                         "tokens": tokens, "unique_tokens": unique, "flops_per_token": fpt, "train_flops": c,
                         "bpb": float(truth.loss(n, effective_tokens(tokens, unique)))})
    grid = Grids([Grid([str(tiny_data)], [1e13, 3e13, 1e14])]).to_json()
    law = fit_law(rows, grid, bootstrap=3)
    law.save(tmp_path / "law.json")
    back = Law.load(tmp_path / "law.json")
    g = back.group("lstm", 300)
    assert back.provenance["corpora"]["tiny"]["vocab"] == 300 and back.provenance["points_fitted"] == 15
    for c in (1e13, 1e14, 4e14):  # within the grid and beyond it
        want = min(sizes, key=lambda s: truth.loss(sizes[s][0], effective_tokens(c / sizes[s][1], unique)))
        assert g.frontier(c, unique)[0]["size"] == want
    assert back.group("gru") is None
    small = fit_law(rows, grid, upto=3e13, bootstrap=0)
    assert small.provenance["budgets_fitted"] == [1e13, 3e13]
    text = table(back, [4e14])
    assert "| 4e+14 |" in text and "| 1e+13 |" in text
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(RptError, match="not a scaling law"):
        Law.load(tmp_path / "bad.json")


def test_a_grid_refuses_what_it_sets_itself(tiny_data, tmp_path):
    with pytest.raises(RptError, match="sets train.max_time"):
        open_grid(tmp_path / "g", Grid([str(tiny_data)], [1e9], sets=["train.max_time=60"]))
    with pytest.raises(RptError, match="three sizes"):
        open_grid(tmp_path / "g", Grid([str(tiny_data)], [1e9], sizes=[(2, 16), (2, 32)]))
    open_grid(tmp_path / "g", Grid([str(tiny_data)], [1e9], sizes=[(2, 16), (2, 24), (2, 32)]))
    more = open_grid(tmp_path / "g", Grid([str(tiny_data)], [1e9], sizes=[(2, 48)]))  # one more size at 1e9
    assert sorted(p.d_model for p in more.points()) == [16, 24, 32, 48]
    with pytest.raises(RptError, match="1 size"):  # but a new budget's sizes are its own
        open_grid(tmp_path / "g", Grid([str(tiny_data)], [3e9], sizes=[(2, 48)]))
    with pytest.raises(RptError, match="not a prepared corpus"):
        open_grid(tmp_path / "g", Grid([str(tmp_path)], [1e9]))
    with pytest.raises(RptError, match="holds no scaling grid"):
        open_grid(tmp_path / "none", None)


def test_points_at_the_recipe_s_batch_are_one_group_whatever_rows_it_chose(tiny_data, tmp_path, monkeypatch):
    from rpt.scaling import runner

    grid = Grids([Grid([str(tiny_data)], [1e9, 3e9], sizes=[(2, 16), (2, 24), (2, 32)])])
    rows_of = {}
    for i, point in enumerate(grid.points()):  # the recipe chose 16 rows for the many-pass points, 64 for the rest
        rows_of[point.name] = 16 if i % 2 else 64
    monkeypatch.setattr(runner, "finished", lambda folder, p: {"tokens": 1e5, "flops_per_token": 1e4,
                                                                "val_bpb": 2.0, "steps": 10})
    monkeypatch.setattr(runner, "run_shape", lambda where: (1000, rows_of[where.name]))
    rows = runner.results(tmp_path, grid)
    assert {r["batch"] for r in rows} == {0} and {r["rows"] for r in rows} == {16, 64}

