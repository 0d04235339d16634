"""The training loop on one process: budgets, accumulation, clipping with a scaler, precisions,
non-finite steps, checkpoints and the errors a user can cause."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rpt.errors import RptError
from rpt.testing.faults import hooks_from_env
from rpt.train.checkpoint.store import CheckpointStore
from rpt.train.trainer import Trainer



def train_losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_runs_to_max_steps_and_writes_the_run_directory(make_cfg, tmp_path, solo):
    summary = Trainer(make_cfg("train.max_steps=12"), tmp_path / "r", solo, show_progress=False).run()
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 4 * 16
    for name in ("config.toml", "meta.json", "tokenizer.json", "metrics.jsonl", "summary.json"):
        assert (tmp_path / "r" / name).is_file(), name
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    for key in ("steps", "tokens", "wall_seconds", "tokens_per_second", "train_loss", "val_loss", "val_ppl", "val_bpb",
                "val_tokens", "val_bytes", "world_size", "comm_mode", "compression", "comm_bytes_total",
                "comm_bytes_per_step", "exposed_comm_fraction", "params"):
        assert key in saved, key
    assert saved["val_bpb"] == pytest.approx(saved["val_loss"] * saved["val_tokens"] / saved["val_bytes"] / 0.6931471805599453)
    losses = train_losses(tmp_path / "r")
    assert sum(losses[-3:]) < sum(losses[:3])


def test_token_and_time_budgets(make_cfg, tmp_path, solo):
    summary = Trainer(make_cfg("train.max_steps=0", "train.max_tokens=300"), tmp_path / "a", solo, show_progress=False).run()
    assert summary["tokens"] >= 300 and summary["steps"] == 5  # 64 tokens a step
    start = time.perf_counter()
    summary = Trainer(make_cfg("train.max_steps=0", "train.max_time=1.5"), tmp_path / "b", solo, show_progress=False).run()
    assert summary["wall_seconds"] >= 1.5 and time.perf_counter() - start < 30
    summary = Trainer(make_cfg("train.max_steps=1000000", "train.max_time=1.0"), tmp_path / "c", solo,
                      show_progress=False).run()
    assert summary["steps"] < 1000000


def test_accumulating_two_halves_equals_one_batch(make_cfg, tmp_path, solo):
    params = []
    for accum in (1, 2):
        trainer = Trainer(make_cfg(f"train.grad_accum={accum}", "train.weight_decay=0"), tmp_path / f"acc{accum}", solo,
                          show_progress=False)
        batch = trainer.loader.batch(0)
        for _ in range(3):  # the state carries across steps as well
            trainer.train_step(batch)
        params.append(torch.cat([p.detach().flatten() for p in trainer.runner.model.parameters()]))
    # AdamW divides by the gradient's own size: summation-order noise in a near-zero gradient entry moves it
    # by up to ~lr x 1e-2 (seen: 5e-5 in 2 of 26,656 entries), while a wrong accumulation moves them by ~lr = 3e-3
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-4)
    assert (params[0] - params[1]).abs().median() < 1e-7


def _norm_at_step(trainer):
    seen = []
    original = trainer.runner.optimizer.step

    def step(*a, **k):
        grads = [p.grad for g in trainer.runner.optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return original(*a, **k)

    trainer.runner.optimizer.step = step
    return seen


def test_clipping_applies_to_unscaled_gradients_with_a_loss_scaler(make_cfg, tmp_path, solo):
    norms = {}
    for precision in ("fp32", "fp16"):
        trainer = Trainer(make_cfg(f"train.precision={precision}", "train.grad_clip=0.05"), tmp_path / precision, solo,
                          show_progress=False)
        seen = _norm_at_step(trainer)
        trainer.train_step(trainer.loader.batch(0))
        norms[precision] = seen[0]
    assert norms["fp32"] == pytest.approx(0.05, rel=1e-4)
    assert norms["fp16"] == pytest.approx(0.05, rel=1e-2)  # not 0.05 x the loss scale (65536)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_paths_train_on_cpu(make_cfg, tmp_path, precision, solo):
    fp32 = Trainer(make_cfg(), tmp_path / "fp32", solo, show_progress=False)
    mixed = Trainer(make_cfg(f"train.precision={precision}"), tmp_path / precision, solo, show_progress=False)
    batch = fp32.loader.batch(0)
    loss32, loss_mixed = fp32.train_step(batch).loss, mixed.train_step(batch).loss
    assert torch.isfinite(loss_mixed) and loss_mixed.item() == pytest.approx(loss32.item(), rel=2e-2)
    summary = mixed.run()
    assert summary["precision"] == precision and summary["val_loss"] < 7.0


def test_non_finite_steps_are_skipped_then_stop_the_run(make_cfg, tmp_path, monkeypatch, solo):
    monkeypatch.setenv("RPT_FAULT", "nan@2")
    trainer = Trainer(make_cfg(), tmp_path / "once", solo, show_progress=False, extra_hooks=hooks_from_env)
    summary = trainer.run()
    assert summary["skipped_steps"] == 1 and summary["steps"] == 6
    monkeypatch.setenv("RPT_FAULT", "nan@2-99")
    trainer = Trainer(make_cfg("train.max_bad_steps=3", "checkpoint.interval=1", "train.max_steps=20"),
                      tmp_path / "always", solo, show_progress=False, extra_hooks=hooks_from_env)
    with pytest.raises(RptError, match="3 optimiser steps in a row had non-finite gradients") as info:
        trainer.run()
    assert "step_00000002" in info.value.fix  # the last good checkpoint is named and kept


def test_a_skipped_step_leaves_parameters_and_optimiser_state_alone(make_cfg, tmp_path, monkeypatch, solo):
    """The skip happens inside fused AdamW (no host sync): nothing of the model or optimiser may move."""
    monkeypatch.setenv("RPT_FAULT", "nan@1")  # the loss of the second step (trainer.progress.step == 1) is poisoned
    trainer = Trainer(make_cfg("train.weight_decay=0.1"), tmp_path / "r", solo, show_progress=False,
                      extra_hooks=hooks_from_env)

    def snapshot():
        opt = trainer.runner.optimizer.state_dict()["state"]
        return ([p.detach().clone() for p in trainer.runner.model.parameters()],
                [{k: v.clone() for k, v in s.items()} for s in opt.values()])

    trainer.train_step(next(trainer.loader))
    trainer.progress.step = 1
    params, moments = snapshot()
    trainer.train_step(next(trainer.loader))
    assert trainer.progress.skipped_steps == 1 and trainer.bad_streak == 1
    params_after, moments_after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(params, params_after))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(moments, moments_after) for k in a)  # step counts too
    trainer.progress.step = 2
    trainer.train_step(next(trainer.loader))
    assert trainer.progress.skipped_steps == 1 and trainer.bad_streak == 0
    assert not all(torch.equal(a, p) for a, p in zip(params, trainer.runner.model.parameters()))


def test_resume_with_another_model_shape_lists_the_keys(make_cfg, tmp_path, solo):
    Trainer(make_cfg("train.max_steps=2"), tmp_path / "r", solo, show_progress=False).run()
    with pytest.raises(RptError, match="another shape") as info:
        Trainer(make_cfg("model.d_model=48", "train.max_steps=4"), tmp_path / "r", solo, resume=True, show_progress=False)
    assert "embed.weight: checkpoint (300, 32), model (300, 48)" in info.value.message
    assert "config.toml" in info.value.fix


def test_checkpoints_keep_last_and_best(make_cfg, tmp_path, solo):
    cfg = make_cfg("train.max_steps=8", "checkpoint.interval=2", "train.eval_interval=2", "checkpoint.keep_last=2",
                   "checkpoint.keep_best=1", "train.early_stop=0")  # retention over the whole run
    trainer = Trainer(cfg, tmp_path / "r", solo, show_progress=False)
    trainer.run()
    complete = CheckpointStore(str(tmp_path / "r" / "checkpoints")).complete(verify=True)
    steps = [m["step"] for _, m in complete]
    evals = {}  # the periodic validation loss of every checkpointed step: the measure that ranks them all
    for record in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()):
        if record["kind"] == "eval" and not record["final"]:
            evals[record["step"]] = record["loss"]
    best = min((loss, step) for step, loss in evals.items())[1]
    assert steps[-2:] == [6, 8] and best in steps and len(steps) <= 3
    assert {m["step"]: m["val_loss"] for _, m in complete} == {step: evals[step] for step in steps}


def test_retention_keeps_the_best_even_when_it_is_old(make_cfg, tmp_path, solo):
    trainer = Trainer(make_cfg(), tmp_path / "r", solo, show_progress=False)
    ck = CheckpointStore(str(tmp_path / "ck"), keep_last=1, keep_best=1)
    for step, val in zip(range(1, 5), (3.0, 1.0, 2.0, 2.5)):
        ck.save(step, trainer.runner.model, trainer.runner.optimizer, {"step": step}, val=(val, 2048))
    assert [m["step"] for _, m in ck.complete()] == [2, 4]
    assert ck.best().endswith("step_00000002") and ck.latest().endswith("step_00000004")
    # a loss over other tokens (a whole split) does not rank against these: the newest measure decides
    ck.keep_last = 2
    ck.set_val_loss(4, (0.5, 9999))
    assert ck.best().endswith("step_00000004")
    ck.set_val_loss(4, (2.9, 2048))
    assert ck.best().endswith("step_00000002")


def test_bad_data_path_and_small_vocabulary(make_cfg, tmp_path, solo):
    with pytest.raises(RptError, match="not a prepared dataset"):
        Trainer(make_cfg(f"data.path={tmp_path}"), tmp_path / "r", solo, show_progress=False)
    with pytest.raises(RptError, match="smaller than the data's vocabulary"):
        Trainer(make_cfg("model.vocab_size=100"), tmp_path / "r", solo, show_progress=False)


@pytest.mark.parametrize("where", ["file", "memory", "async"])
def test_checkpoints_to_urls_and_in_the_background_resume(make_cfg, tmp_path, solo, where):
    path = {"file": f"file://{tmp_path}/ck", "memory": f"memory://ck-{tmp_path.name}", "async": ""}[where]
    extra = ["checkpoint.async_save=true"] if where == "async" else [f"checkpoint.path={path}"]
    first = Trainer(make_cfg("train.max_steps=3", "checkpoint.interval=2", *extra), tmp_path / "r", solo,
                    show_progress=False)
    first.run()
    store = CheckpointStore(first.cfg.checkpoint.path or str(tmp_path / "r" / "checkpoints"))
    assert [m["step"] for _, m in store.complete(verify=True)][-1] == 3
    resumed = Trainer(make_cfg("train.max_steps=5", *extra), tmp_path / "r", solo, resume=True, show_progress=False)
    assert resumed.progress.step == 3
    for a, b in zip(first.runner.model.parameters(), resumed.runner.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.run()["steps"] == 5


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(make_cfg, tmp_path, solo, caplog):
    trainer = Trainer(make_cfg("train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep_last=3"), tmp_path / "r",
                      solo, show_progress=False)
    trainer.run()
    store = CheckpointStore(str(tmp_path / "r" / "checkpoints"))
    newest = store.complete()[-1][0]
    shard = next(p for p in (tmp_path / "r" / "checkpoints").glob("step_00000004/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    with caplog.at_level("WARNING", logger="rpt.checkpoint"):
        assert store.latest().endswith("step_00000002")
    assert "step_00000004" in caplog.text and "bytes" in caplog.text
    assert newest.endswith("step_00000004")


def test_a_pipeline_the_ranks_cannot_hold_is_refused(make_cfg, tmp_path, solo):
    with pytest.raises(RptError, match="world size 1 is not divisible by parallel.pp = 2"):
        Trainer(make_cfg("parallel.pp=2"), tmp_path / "r", solo, show_progress=False)
    with pytest.raises(RptError, match="larger than model.n_layers"):
        make_cfg("parallel.pp=3")
    with pytest.raises(RptError, match="grad_accum"):
        make_cfg("parallel.pp=2", "train.grad_accum=2")
    with pytest.raises(RptError, match="parameter servers"):
        make_cfg("parallel.pp=2", "comm.mode=ps")


@pytest.mark.parametrize("cell,recompute", [("lstm", False), ("modlstm", False), ("mingru", True), ("lstm", True)])
def test_compiled_blocks_train_as_eager_ones(make_cfg, tmp_path, solo, cell, recompute):
    """train.compile compiles each block in place: the same losses and parameters as eager (aot_eager traces
    forward and backward as inductor does, without generating code), with the state carried across steps, with
    activation checkpointing inside the compiled block too, and the same parameter names, so checkpoints do not
    depend on it."""
    trainers = []
    for backend in ("", "aot_eager"):
        torch._dynamo.reset()
        trainer = Trainer(make_cfg(f"model.cell={cell}", "model.dropout=0", f"train.compile={backend}",
                                   f"model.activation_checkpointing={str(recompute).lower()}"),
                          tmp_path / f"run-{backend or 'eager'}", solo, show_progress=False)
        batch = trainer.loader.batch(0)
        trainer.losses = [trainer.train_step(batch).loss.item() for _ in range(3)]
        trainers.append(trainer)
    eager, compiled = trainers
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.runner.model.blocks.values())
    assert list(eager.runner.model.state_dict()) == list(compiled.runner.model.state_dict())
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=0)
    for (name, a), b in zip(eager.runner.model.named_parameters(), compiled.runner.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4, msg=name)  # Adam turns rounding into steps of up to lr


def test_an_unknown_compile_backend_is_refused(make_cfg):
    with pytest.raises(RptError, match="not a torch.compile backend"):
        make_cfg("train.compile=fast")


def test_a_compiled_run_breaks_no_graph_at_its_log_lines(make_cfg, tmp_path, solo):
    """The gate-saturation probe of every logged step runs the blocks' own forwards, not the compiled ones: its
    counting (a host read per gate) broke their graphs and recompiled them at each log line, about 35 lines of
    dynamo warnings and a run 13x slower than eager (issue 43). Two runs, of 2 and 5 logged steps, trace the same
    graphs, and none breaks at a host read."""
    from torch._dynamo.utils import counters

    graphs = []
    for steps in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        Trainer(make_cfg("train.compile=aot_eager", f"train.max_steps={steps}", "monitor.log_interval=1"),
                tmp_path / f"run-{steps}", solo, show_progress=False).run()
        assert not [reason for reason in counters["graph_break"] if "item()" in reason]
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1]
