"""`rpt export RUN_DIR --out DIR`: a run's checkpoint as a Hugging Face transformers folder.

    DIR/model.safetensors (or model-0000K-of-0000N.safetensors + model.safetensors.index.json above --max-shard-size)
    DIR/config.json, generation_config.json      model_type "rpt", auto_map to the two files below
    DIR/configuration_rpt.py, modeling_rpt.py     the model in torch + transformers only (rpt/export/hf/)
    DIR/spec_cell.py, spec_stack.py, spec_loop.py the maths: the family's rpt/ops/FAMILY/spec.py, the stack's, the loop's
    DIR/tokenizer.json, tokenizer_config.json    the run's tokenizer (it adds no special token: the model starts
                                                 every fresh row from the end-of-text token's state)

transformers' own `save_pretrained` writes the weights (sharding, tied weights), the config and the code files,
so the folder is what `from_pretrained(DIR, trust_remote_code=True)` expects of any remote-code model.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from rpt.errors import RptError
from rpt.ops.modlstm.spec import GATES as SPEC_GATES

CONFIG_FILE = "configuration_rpt.py"
GATES = (*SPEC_GATES, "exp")  # the gates the exported spec knows (a registered gate of a user's is not in it)


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise RptError("rpt export and rpt lm-eval need Hugging Face transformers",
                       "pip install 'rpt[hf]' (or: pip install 'transformers>=5.20,<6')") from None


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str = "best", max_shard_size: str = "5GB",
               force: bool = False) -> dict:
    """Write the export of `run_dir`'s checkpoint to `out`; returns what was written."""
    require_transformers()
    from rpt.train.init_from import run_tokenizer_sha256
    from rpt.train.run_dir import load_run

    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise RptError(f"{out} exists and is not empty", "choose another --out, or pass --force to replace it")
    cfg, model, tokenizer, path, ck = load_run(run_dir, checkpoint, "cpu")
    if out.exists():
        shutil.rmtree(out)
    export_model(cfg, model, run_dir / "tokenizer.json", out, run_tokenizer_sha256(run_dir),
                 f"{run_dir.name}, checkpoint {ck.describe(path)}", max_shard_size)
    return {"out": str(out), "checkpoint": path, "about": ck.describe(path),
            "files": sorted(p.name for p in out.iterdir()), "params": sum(p.numel() for p in model.parameters())}


def export_model(cfg, model, tokenizer_path: Path, out: Path, tokenizer_sha256: str = "", about: str = "",
                 max_shard_size: str = "5GB") -> None:
    """Write `model` (a whole RecurrentLM of `cfg`, its weights folded in place) as a transformers folder."""
    from transformers import PreTrainedTokenizerFast

    from rpt.data.tokenizer import eot_id, load_tokenizer
    from rpt.export.hf.modeling_rpt import RptForCausalLM
    from rpt.models.registry import CELLS

    m = cfg.model
    spec = CELLS[m.cell].export_spec
    if spec is None:
        exportable = ", ".join(name for name, cell in CELLS.items() if cell.export_spec)
        raise RptError(f"model.cell = '{m.cell}' has no exported step (its class sets no export_spec): the exported "
                       f"folder runs a family's spec file ({exportable})",
                       "export a run of one of those, or give the cell an export_spec (docs/cells.md)")
    if m.cell == "modlstm" and m.gate not in GATES:
        raise RptError(f"model.gate = '{m.gate}' is a gate of your own: the exported modeling file knows "
                       f"{', '.join(GATES)}", "export a run with a built-in gate, or use the run with rpt")
    if m.loop_core and m.loop_init != "zero":
        raise RptError(f"model.loop_init = '{m.loop_init}': the exported model starts each token's iterations from "
                       "zero, and would not give this model's (random) results",
                       "export a looped model trained with model.loop_init = 'zero'")
    tok = load_tokenizer(tokenizer_path)
    fold_weight_norm(model)
    config = hf_config(cfg, model, eot_id(tok), tokenizer_sha256)
    hf = RptForCausalLM(config)
    hf.load_state_dict(model.state_dict(), strict=True)  # the same names on both sides: every key, every shape
    type(hf.config).register_for_auto_class()
    type(hf).register_for_auto_class("AutoModelForCausalLM")
    hf.save_pretrained(out, max_shard_size=max_shard_size)
    shutil.copyfile(importlib.import_module(spec).__file__, out / "spec_cell.py")  # the family's own, for the stand-in
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("*.py")) if p.name != CONFIG_FILE))
    config_file = out / CONFIG_FILE  # (configuration_rpt.py's CODE: why)
    config_file.write_text(config_file.read_text().replace('\nCODE = ""\n', f'\nCODE = "{code.hexdigest()[:16]}"\n', 1))
    eot = tok.id_to_token(config.eot_token_id)  # adds no special token: each row starts as a document by itself
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=eot,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    (out / "README.md").write_text(_model_card(out, about, config))
    mode = (out / "README.md").stat().st_mode & 0o777  # the weights are written private (a temporary file renamed):
    for p in out.iterdir():  # give every file the mode this user's files get, so that a shared export is readable
        p.chmod(mode)


def fold_weight_norm(model: torch.nn.Module) -> None:
    """Replace weight normalisation's (g, v) by the weight it makes: the exported model has plain matrices."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)


def hf_config(cfg, model, eot: int, tokenizer_sha256: str):
    from rpt.export.hf.configuration_rpt import RptConfig

    m = cfg.model
    first = next(iter(model.blocks.values()))
    return RptConfig(vocab_size=m.vocab_size, cell=m.cell, n_layers=m.n_layers, d_model=m.d_model,
                     d_hidden=first.cell.d_hidden, norm=m.norm, mlp_ratio=m.mlp_ratio,
                     attention_every=m.attention_every, attention_window=m.attention_window,
                     attention_heads=m.attention_heads, head_shortlist=m.head_shortlist, gate=m.gate,
                     gate_norm=m.gate_norm, coupled_gates=m.coupled_gates, peepholes=m.peepholes, heads=m.heads,
                     loop_prelude=m.loop_prelude, loop_core=m.loop_core, loop_depth=round(m.loop_mean),
                     loop_slots=m.loop_cap, loop_inject=m.loop_inject,
                     reset_at_eot=cfg.data.reset_at_documents, eot_token_id=eot, tie_word_embeddings=m.tie_embeddings,
                     tokenizer_sha256=tokenizer_sha256, architectures=["RptForCausalLM"])


def _model_card(out: Path, about: str, config) -> str:
    loop = "" if not config.loop_core else f"""
Its blocks {config.loop_prelude + 1}-{config.loop_prelude + config.loop_core} are a looped core (depth recurrence):
they run `num_steps` times a token, {config.loop_depth} by default (`loop_depth` in config.json, the mean it trained
at); more iterations spend more compute on each token. Choose the depth per call, as Huginn's model takes it:
`model(ids, num_steps=8)`, `model.generate(ids, max_new_tokens=50, num_steps=8)`, or for lm-evaluation-harness
`--model_args pretrained=DIR,trust_remote_code=True,loop_depth=8` (`rpt lm-eval DIR --depth 8`).
"""
    return f"""# {out.name} (rpt)

A recurrent language model trained with rpt: {config.n_layers} x {config.d_model} {config.cell}, vocabulary
{config.vocab_size}; {about}.
{loop}
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
ids = tok("def main(", return_tensors="pt").input_ids        # a fresh row starts as a document
print(tok.decode(model.generate(ids, max_new_tokens=50, do_sample=False)[0]))
```

modeling_rpt.py runs the reference forms of the cells (a loop over time in plain torch): exact, on any device,
slower than rpt. Continue training with rpt: `train.init_from = "{out.name}"` (this folder's path).
"""
