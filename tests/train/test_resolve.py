"""A run's configuration is resolved once (rpt/train/resolve.py) and frozen: the user's stays as loaded, the run's
is changed by no module after resolving (any change raises), and config.toml says where each value came from."""

from __future__ import annotations

import pytest

from rpt.cli import load_config
from rpt.config import Config, Frozen
from rpt.errors import RptError
from rpt.train.trainer import Trainer


def test_a_run_completes_on_a_frozen_configuration_and_records_each_origin(make_cfg, tmp_path, solo):
    user = make_cfg("train.recipe=auto", "train.max_steps=3", "model.vocab_size=0")
    before = user.to_dict()
    trainer = Trainer(user, tmp_path / "r", solo, show_progress=False)
    run = trainer.cfg
    assert run.frozen and user.frozen and run is not user
    with pytest.raises(Frozen):
        run.train.lr = 1.0
    with pytest.raises(Frozen):
        run.set("model.d_model", 8)
    assert trainer.run()["steps"] == 3  # every module read the frozen configuration: none wrote to it
    assert user.to_dict() == before and user.model.vocab_size == 0  # the user's, as loaded
    assert run.model.vocab_size == 300

    text = (tmp_path / "r" / "config.toml").read_text()
    line = {ln.split(" = ")[0]: ln for ln in text.splitlines() if " = " in ln}
    assert line["vocab_size"].endswith("# the data (meta.json)")
    assert line["max_steps"].endswith("# --set") and line["log_interval"].endswith("# --set")
    assert line["tie_embeddings"].endswith("# default")
    chosen = [key for key, ln in line.items() if ln.endswith("# the default recipe")]
    assert chosen and all(key not in ("max_steps", "vocab_size") for key in chosen)  # it kept off what was given
    again = Config.load(tmp_path / "r" / "config.toml")  # the comments are comments: the file loads back
    assert again.to_dict() == run.to_dict()


def test_checks_that_span_sections_are_the_resolving_modules_and_every_command_runs_them(tiny_data):
    raw = Config.load(None, ["parallel.pp=2", "comm.mode=ps"])  # each section on its own is fine
    assert raw.parallel.pp == 2
    with pytest.raises(RptError, match="do not run over a pipeline") as info:
        load_config(None, ["parallel.pp=2", "comm.mode=ps"])
    assert "allreduce" in info.value.fix


def test_old_spellings_of_cell_options_keep_working_or_name_the_cell(tiny_data):
    assert load_config(None, ["model.cell=modlstm", "model.gate=exp"]).model.gate == "exp"
    with pytest.raises(RptError, match="model.gate applies to model.cell = .*'modlstm'") as info:  # (and any cell a
        load_config(None, ["model.cell=lstm", "model.gate=exp"])                                # test registered)
    assert "set model.cell = '" in info.value.fix
    with pytest.raises(RptError, match="model.forget_bias applies to"):  # a default derived, not copied
        load_config(None, ["model.cell=gru", "model.forget_bias=2.0"])
