"""Configuration: overrides coerce to each field's type; mistakes fail with the fix in the message."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rpt.config import Config
from rpt.errors import RptError
from rpt.train.resolve import check

REPO = Path(__file__).resolve().parents[1]


def load(path=None, overrides=()):
    """What every command loads: Config.load, then the checks that span sections (rpt/train/resolve.py)."""
    cfg = Config.load(path, overrides)
    check(cfg)
    return cfg


def test_overrides_coerce_to_field_types():
    cfg = load(None, ["train.max_steps=1e3", "train.lr=0.01", "model.tie_embeddings=false",
                             "train.betas=0.8,0.99", "parallel.pp=auto", "train.precision=bf16",
                             "data.path=123", "model.n_layers=4", "comm.bucket_mb=5"])
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.lr == 0.01
    assert cfg.model.tie_embeddings is False
    assert cfg.train.betas == [0.8, 0.99]
    assert cfg.parallel.pp == "auto"
    assert cfg.train.precision == "bf16"
    assert cfg.data.path == "123"  # a string field keeps the text as written
    assert cfg.comm.bucket_mb == 5.0 and isinstance(cfg.comm.bucket_mb, float)
    assert load(None, ["train.betas=[0.5, 0.6]", "parallel.pp=2"]).parallel.pp == 2


def test_toml_file_then_overrides_and_round_trip(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nd_model = 32\ncell = "gru"\n[train]\nmax_steps = 7\n')
    cfg = load(path, ["train.max_steps=9"])
    assert (cfg.model.d_model, cfg.model.cell, cfg.train.max_steps) == (32, "gru", 9)
    cfg.save(tmp_path / "resolved.toml")
    assert load(tmp_path / "resolved.toml") == cfg


@pytest.mark.parametrize("override, message, fix", [
    ("train.max_stepz=3", "unknown key 'train.max_stepz'", "did you mean 'train.max_steps'"),
    ("trian.seed=1", "unknown section 'trian'", "did you mean 'train'"),
    ("train.max_steps=abc", "is not an integer", "--set train.max_steps="),
    ("train.precision=fp8", "is not one of 'fp32', 'bf16', 'fp16'", "--set train.precision="),
    ("model.tie_embeddings=maybe", "is not true or false", "--set model.tie_embeddings=true"),
    ("train.betas=[a]", "is not a list of a number", "train.betas"),
    ("parallel.pp=9", "larger than model.n_layers", "parallel.pp <= 2"),
    ("train.batch_size=0", "must be positive", "train.batch_size"),
    ("model.dropout=1.5", "outside [0, 1)", "0.1"),
    ("parallel.microbatches=3", "not divisible", "divides the batch size"),
    ("train.max_steps=0", "never end", "budget"),
    ("comm.compression=powersgd", None, None),
    ("justakey", "has no '='", "section.key=value"),
    ("nodot=1", "not of the form section.key", "--set train.max_steps"),
])
def test_validation_messages_name_the_fix(override, message, fix):
    if message is None:
        load(None, [override])  # valid on its own
        return
    with pytest.raises(RptError) as info:
        load(None, [override])
    assert message in info.value.message
    assert fix in (info.value.fix or "")


def test_a_head_shortlist_needs_a_larger_vocabulary():
    with pytest.raises(RptError, match="not below the vocabulary") as info:
        load(None, ["model.vocab_size=512", "model.head_shortlist=512"])
    assert "or 0 for none" in info.value.fix
    assert load(None, ["model.head_shortlist=64", "parallel.pp=2"]).model.head_shortlist == 64  # a pipeline too


def test_impossible_combination_names_the_fix():
    with pytest.raises(RptError, match="does not do") as info:
        load(None, ["comm.compression=powersgd", "comm.mode=ps"])
    assert "allreduce" in info.value.fix


@pytest.mark.parametrize("overrides, message, fix", [
    (["comm.mode=diloco", "comm.diloco_steps=30"], "agree only at outer steps", "multiple of 30"),
    (["comm.mode=diloco", "comm.compression=topk"], "pseudo-gradient whole", "int8"),
    (["comm.mode=diloco", "comm.diloco_momentum=1"], "momentum in [0, 1)", "0.9"),
    (["comm.compression=int8"], "DiLoCo's outer payload", "comm.mode = 'diloco'"),
    (["comm.mode=diloco", "parallel.pp=2"], "data-parallel dimension", "allreduce"),
])
def test_diloco_settings_that_cannot_work_are_refused_with_the_fix(overrides, message, fix):
    load(None, ["comm.mode=diloco", "comm.compression=int8", "train.eval_interval=100"])  # a valid one
    with pytest.raises(RptError) as info:
        load(None, overrides)
    assert message in info.value.message and fix in info.value.fix


@pytest.mark.parametrize("overrides, message, fix", [
    (["comm.mode=ps-sharded"], "FSDP reduce-scatters the gradients itself", "comm.mode = 'allreduce'"),
    (["comm.mode=diloco", "train.eval_interval=100"], "FSDP reduce-scatters", "parallel.fsdp = 1"),
    (["comm.compression=powersgd"], "compression = 'powersgd'", "compression 'none'"),
    (["comm.adaptive=true"], "adaptive", "comm.mode = 'allreduce'"),
    (["train.precision=fp16"], "loss scaling over sharded gradients", "bf16"),
    (["parallel.pp=2", "parallel.schedule=interleaved", "model.n_layers=4"], "one pipeline stage per rank", "1f1b"),
    (["parallel.fsdp=0"], "parallel.fsdp", ""),
])
def test_fsdp_settings_that_cannot_work_are_refused_with_the_fix(overrides, message, fix):
    load(None, ["parallel.fsdp=2", "parallel.pp=2", "model.n_layers=4"])  # valid ones
    load(None, ["parallel.fsdp=auto", "train.precision=bf16"])
    with pytest.raises(RptError) as info:
        load(None, ["parallel.fsdp=2", *overrides])
    assert message in info.value.message and fix in info.value.fix


@pytest.mark.parametrize("overrides, message, fix", [
    (["train.seq_len=63"], "not divisible by parallel.cp = 2", "train.seq_len = 62"),
    (["model.attention_every=2", "model.attention_window=64"], "shorter than model.attention_window = 64",
     "train.seq_len >= 128"),
    (["parallel.pp=2", "model.n_layers=4"], "parallel.pp = 2", "train.bptt_chunk alone"),
    (["parallel.fsdp=2"], "parallel.fsdp = 2", "drop them"),
    (["train.bptt_chunk=16"], "train.bptt_chunk = 16", "drop them"),
    (["model.loop_core=1", "model.n_layers=3"], "model.loop_core = 1", "drop them"),
    (["model.activation_checkpointing=true"], "activation_checkpointing", "drop them"),
    (["comm.mode=diloco"], "comm.mode = 'diloco'", "drop them"),
    (["parallel.cp=0"], "parallel.cp", ""),
])
def test_context_parallel_settings_that_cannot_work_are_refused_with_the_fix(overrides, message, fix):
    load(None, ["parallel.cp=2", "train.seq_len=64", "model.attention_every=2", "model.attention_window=32"])
    with pytest.raises(RptError) as info:
        load(None, ["parallel.cp=2", "train.seq_len=64", *overrides])
    assert message in info.value.message and fix in info.value.fix


def test_malformed_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ncell = lstm\n")
    with pytest.raises(RptError, match="not valid TOML"):
        load(bad)
    with pytest.raises(RptError, match="does not exist"):
        load(tmp_path / "none.toml")
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[model]\nn_layers = "many"\n')
    with pytest.raises(RptError, match="model.n_layers = 'many' is not an integer"):
        load(wrong)


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_preset_loads(preset):
    load(preset)


def test_cli_config_prints_resolved_toml():
    proc = subprocess.run([sys.executable, "-m", "rpt", "config", "--config", str(REPO / "configs/tiny-cpu.toml"),
                           "--set", "train.seed=5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "seed = 5  # --set" in proc.stdout and "d_model = 64  # " in proc.stdout  # each value's origin
    assert "tiny-cpu.toml" in next(line for line in proc.stdout.splitlines() if line.startswith("d_model"))
    assert "weight_decay = 0.1  # default" in proc.stdout
    assert tomllib.loads(proc.stdout)["train"]["seed"] == 5  # still TOML that loads
