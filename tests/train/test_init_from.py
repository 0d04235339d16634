"""train.init_from: a new run from earlier weights (a run, a checkpoint, an export), fresh parts on request, and one
clear message for weights that do not fit."""

from __future__ import annotations

import pytest
import torch

from rpt.config import Config
from rpt.data.prepare import PrepareOptions, prepare
from rpt.errors import RptError
from rpt.train.init_from import read_weights
from rpt.train.trainer import Trainer


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_data):
    """A finished run of an untied lstm."""
    from rpt.parallel.launch import Dist

    run = tmp_path_factory.mktemp("init") / "source"
    cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=32", "model.tie_embeddings=false",
                             "train.batch_size=4", "train.seq_len=16", "train.max_steps=8", "train.eval_interval=0",
                             "train.eval_tokens=512", "train.lr=0.01", "monitor.tensorboard=false"])
    Trainer(cfg, run, Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), show_progress=False).run()
    return run


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.runner.model.state_dict().items()}


def test_weights_of_a_run_or_a_checkpoint_start_the_new_run(make_cfg, solo, source, tmp_path):
    saved = read_weights(source).tensors
    for i, path in enumerate([source, next((source / "checkpoints").glob("step_*"))]):
        t = Trainer(make_cfg("model.tie_embeddings=false", f"train.init_from={path}"), tmp_path / f"r{i}", solo,
                    show_progress=False)
        got = params(t)
        assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in got)
        assert t.progress.step == 0 and t.runner.optimizer.state == {}  # a fresh optimiser and schedule
    fresh = params(Trainer(make_cfg("model.tie_embeddings=false"), tmp_path / "fresh", solo, show_progress=False))
    assert not torch.equal(fresh["blocks.0.cell.w_hh"], saved["blocks.0.cell.w_hh"])


def test_a_new_head_starts_fresh_while_the_rest_loads(make_cfg, solo, source, tmp_path):
    saved = read_weights(source).tensors
    cfg = ["model.tie_embeddings=false"]
    got = params(Trainer(make_cfg(*cfg, f"train.init_from={source}", 'train.init_fresh=["head"]'), tmp_path / "a",
                         solo, show_progress=False))
    fresh = params(Trainer(make_cfg(*cfg), tmp_path / "b", solo, show_progress=False))
    assert torch.equal(got["head.weight"], fresh["head.weight"]) and not torch.equal(got["head.weight"], saved["head.weight"])
    assert all(torch.equal(got[k], saved[k]) for k in got if not k.startswith("head."))
    summary = Trainer(make_cfg(*cfg, f"train.init_from={source}", 'train.init_fresh=["head"]'), tmp_path / "c", solo,
                      show_progress=False).run()
    assert summary["steps"] == 6


def test_another_tokenizer_is_refused_unless_embedding_and_head_start_fresh(make_cfg, solo, source, tmp_path,
                                                                             small_corpus):
    other = tmp_path / "other"
    prepare(PrepareOptions(out=other, inputs=[str(small_corpus / "a")], vocab_size=280, val_fraction=0.2,
                           progress=False))
    base = [f"data.path={other}", "model.tie_embeddings=false", f"train.init_from={source}"]
    with pytest.raises(RptError, match="another tokenizer") as err:
        Trainer(make_cfg(*base), tmp_path / "r1", solo, show_progress=False)
    assert "init_fresh" in err.value.fix and not (tmp_path / "r1").exists()
    got = params(Trainer(make_cfg(*base, 'train.init_fresh=["embed", "head"]'), tmp_path / "r2", solo, show_progress=False))
    saved = read_weights(source).tensors
    assert got["embed.weight"].shape[0] == 280 and torch.equal(got["blocks.1.cell.w_ih"], saved["blocks.1.cell.w_ih"])


def test_weights_that_do_not_fit_list_every_key(make_cfg, solo, source, tmp_path):
    with pytest.raises(RptError) as err:
        Trainer(make_cfg("model.tie_embeddings=false", "model.d_model=48", f"train.init_from={source}"),
                tmp_path / "r", solo, show_progress=False)
    text = str(err.value)
    assert "blocks.0.cell.w_ih: (128, 32) there, (192, 48) in this model" in text and "norm.weight" in text
    with pytest.raises(RptError, match="not a run directory, a checkpoint folder or an rpt export"):
        Trainer(make_cfg(f"train.init_from={tmp_path}"), tmp_path / "r2", solo, show_progress=False)
    with pytest.raises(RptError, match="init_fresh is set without train.init_from"):
        make_cfg('train.init_fresh=["head"]').validate()
    with pytest.raises(RptError, match="not a part of the model"):
        make_cfg(f"train.init_from={source}", 'train.init_fresh=["heads"]').validate()
