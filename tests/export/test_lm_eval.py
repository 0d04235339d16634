"""rpt lm-eval: lm-evaluation-harness's own `hf` model on an export scores a local task's texts with the
log-likelihoods rpt's evaluation gives them; a run directory is exported first; bad folders get one message."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from rpt.config import Config
from rpt.errors import RptError
from rpt.export.hf_export import export_run
from rpt.export.lm_eval_run import run_lm_eval
from rpt.parallel.launch import Dist
from rpt.train.run_dir import load_run
from rpt.train.trainer import Trainer

DOCS = [{"context": "First Citizen:\nBefore we proceed any further, hear me", "continuation": " speak."},
        {"context": "All:\nSpeak,", "continuation": " speak."},
        {"context": "You are all resolved rather to die than", "continuation": " to famish?"},
        {"context": "MENENIUS:\nWhat work's, my countrymen, in hand?", "continuation": " Where go you"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_data) -> tuple[Path, Path, Path]:
    """(run, its export, a folder holding the task rpt_local: a loglikelihood task on a local jsonl file)."""
    root = tmp_path_factory.mktemp("lm-eval")
    cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=32", "model.cell=modlstm", "train.batch_size=4",
                             "train.seq_len=16", "train.max_steps=10", "train.eval_interval=0", "train.eval_tokens=256",
                             "model.attention_every=2", "model.attention_window=8", "monitor.tensorboard=false"])
    Trainer(cfg, root / "run", Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), show_progress=False).run()
    export_run(root / "run", root / "hf")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "local.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "rpt_local.yaml").write_text(f"""task: rpt_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'local.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
""")
    (tasks / "rpt_rolling.yaml").write_text(f"""task: rpt_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'local.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{context}}}}{{{{continuation}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""")
    return root / "run", root / "hf", tasks


def rpt_loglikelihood(model, tokenizer, context: str, continuation: str, depth: int | None = None) -> float:
    """The continuation's log-probability after the context, from rpt's own forward (its per-token nats)."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ctx = [eot] + (tokenizer.encode(context, add_special_tokens=False).ids if context else [])
    whole = [eot] + tokenizer.encode(context + continuation, add_special_tokens=False).ids
    x = torch.tensor(whole)[None]
    with torch.no_grad():
        nats, _ = model(x[:, :-1], reset_mask=x[:, :-1] == eot, targets=x[:, 1:], depth=depth)
    return -float(nats[0, len(ctx) - 1:].sum())


def test_local_task_log_likelihoods_equal_rpts_own(exported):
    """Continuations after a context, and whole texts (a perplexity task's rolling requests, which lm-eval starts
    with the end-of-text token itself): each as rpt scores the document."""
    run, folder, tasks = exported
    results = run_lm_eval(folder, ["rpt_local", "rpt_rolling"], include_path=str(tasks), batch_size=2,
                          log_samples=True)
    _, model, tokenizer, *_ = load_run(run, "best", "cpu")
    samples = results["samples"]["rpt_local"]
    assert len(samples) == len(DOCS)
    for s in samples:
        ll = s["resps"][0][0][0]
        assert ll == pytest.approx(rpt_loglikelihood(model, tokenizer, s["doc"]["context"], s["doc"]["continuation"]),
                                   abs=1e-4)
    assert results["results"]["rpt_local"]["perplexity,none"] > 1
    rolling = results["samples"]["rpt_rolling"]
    assert len(rolling) == len(DOCS)
    for s in rolling:
        text = s["doc"]["context"] + s["doc"]["continuation"]
        assert s["resps"][0][0] == pytest.approx(rpt_loglikelihood(model, tokenizer, "", text), abs=1e-4)
    # read in windows of 8 tokens, each from a fresh state, the texts score otherwise (max_length reaches lm-eval)
    short = run_lm_eval(folder, ["rpt_rolling"], include_path=str(tasks), log_samples=True, max_length=8)
    windowed = [s["resps"][0][0] for s in short["samples"]["rpt_rolling"]]
    assert max(abs(a - b["resps"][0][0]) for a, b in zip(windowed, rolling)) > 0.1


def test_rpt_lm_eval_command_exports_a_run_first(exported, tmp_path, cli, monkeypatch):
    """The command, through its entry point in this process (lm-eval and transformers are imported already: a
    process of its own spent most of its 20 s importing them)."""
    run, _, tasks = exported
    out = tmp_path / "results.json"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    proc = cli("lm-eval", str(run), "--tasks", "rpt_local", "--include-path", str(tasks), "--output", str(out),
               "--max-length", "4096")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rpt_local" in proc.stdout and "perplexity" in proc.stdout
    assert json.loads(out.read_text())["results"]["rpt_local"]["perplexity,none"] > 1


def test_lm_eval_refuses_what_it_cannot_run(exported, tmp_path):
    _, folder, tasks = exported
    with pytest.raises(RptError, match="neither an rpt export nor a run directory"):
        run_lm_eval(tmp_path, ["rpt_local"], include_path=str(tasks))
    with pytest.raises(RptError, match="knows no task 'no_such_task'"):
        run_lm_eval(folder, ["no_such_task"], include_path=str(tasks))


def test_a_looped_model_scores_at_the_depth_given(exported, tiny_data, tmp_path):
    """`depth` reaches the exported model (loop_depth in lm-eval's model arguments): each depth's
    log-likelihoods are rpt's own at that depth, and they differ between depths. The core is an mlstm: a matrix
    state through the loop, the export and lm-eval."""
    _, _, tasks = exported
    cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=32", "model.cell=mlstm", "model.heads=2",
                             "model.chunk_size=8", "model.n_layers=3",
                             "model.loop_prelude=1", "model.loop_core=1", "model.loop_mean=2", "train.batch_size=4",
                             "train.seq_len=16", "train.max_steps=6", "train.eval_interval=0", "train.eval_tokens=256",
                             "train.eval_depths=[2]", "monitor.tensorboard=false"])
    Trainer(cfg, tmp_path / "run", Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
            show_progress=False).run()
    export_run(tmp_path / "run", tmp_path / "hf")
    _, model, tokenizer, *_ = load_run(tmp_path / "run", "best", "cpu")
    scores = {}
    for depth in (1, 3):
        results = run_lm_eval(tmp_path / "hf", ["rpt_local"], include_path=str(tasks), batch_size=2,
                              log_samples=True, depth=depth)
        scores[depth] = [s["resps"][0][0][0] for s in results["samples"]["rpt_local"]]
        for s, ll in zip(results["samples"]["rpt_local"], scores[depth]):
            ours = rpt_loglikelihood(model, tokenizer, s["doc"]["context"], s["doc"]["continuation"], depth)
            assert ll == pytest.approx(ours, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(scores[1], scores[3])) > 1e-3
    with pytest.raises(RptError, match="at least once"):
        run_lm_eval(tmp_path / "hf", ["rpt_local"], include_path=str(tasks), depth=0)
    with pytest.raises(RptError, match="without a loop"):
        run_lm_eval(exported[1], ["rpt_local"], include_path=str(tasks), depth=2)
    # a run directory's depth is checked before it is exported (issue 58: it exported first, then refused)
    with pytest.raises(RptError, match=r"without a loop \(model.loop_core = 0\)"):  # the run's config.toml's words
        run_lm_eval(exported[0], ["rpt_local"], include_path=str(tasks), depth=4)
