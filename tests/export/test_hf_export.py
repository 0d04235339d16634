"""rpt -> transformers -> rpt: the exported folder loads with AutoModelForCausalLM (trust_remote_code), gives rpt's
logits within 1e-5 for every cell, head and block kind, generates rpt's greedy text with constant memory, and
loads back into rpt (train.init_from) with the same logits."""

from __future__ import annotations

import ast

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rpt  # noqa: E402
from rpt.errors import RptError
from rpt.export.hf_export import export_model, export_run
from rpt.models import RecurrentLM
from rpt.models.decoder import Decoder
from rpt.train.init_from import load_weights, read_weights
from rpt.train.run_dir import load_run
from rpt.train.trainer import Trainer

VARIANTS = {  # name: the model settings of a run (every cell; attention, MLP, both heads, weight norm)
    "lstm-attn": ["model.cell=lstm", "model.attention_every=2", "model.attention_heads=2", "model.attention_window=6"],
    "gru-untied": ["model.cell=gru", "model.tie_embeddings=false", "model.norm=layernorm", "model.heads=2"],
    "modlstm-exp": ["model.cell=modlstm", "model.gate=exp", "model.gate_norm=true", "model.d_hidden=48",
                    "model.heads=4"],
    "modlstm-peep": ["model.cell=modlstm", "model.gate=hard_sigmoid", "model.peepholes=true", "model.mlp_ratio=2"],
    "modlstm-coupled": ["model.cell=modlstm", "model.coupled_gates=true", "model.weight_norm=true"],
    "mingru-short": ["model.cell=mingru", "model.head_shortlist=40"],
    "mlstm": ["model.cell=mlstm", "model.heads=4", "model.chunk_size=5", "model.mlp_ratio=2"],
    # Qwen3-Next's ratio: three gdn blocks to one attention block
    "gdn-hybrid": ["model.cell=gdn", "model.heads=4", "model.chunk_size=5", "model.n_layers=4", "model.attention_every=4",
                   "model.attention_heads=2", "model.attention_window=6"],
    "minlstm": ["model.cell=minlstm", "model.attention_every=1", "model.attention_heads=4", "model.attention_window=4"],
    "mingru-looped": ["model.cell=mingru", "model.n_layers=3", "model.loop_prelude=1", "model.loop_core=1",
                      "model.loop_mean=3", "model.attention_every=2", "model.attention_heads=2",
                      "model.attention_window=6", "model.loop_inject=linear", "train.eval_depths=[3]"],
    "lstm-looped-add": ["model.cell=lstm", "model.n_layers=3", "model.loop_prelude=1", "model.loop_core=1",
                        "model.loop_mean=2", "train.eval_depths=[2]"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> dict[str, tuple[Path, Path]]:
    """Each variant trained for 3 steps, and its export: name -> (run directory, export folder)."""
    from rpt.config import Config
    from rpt.parallel.launch import Dist

    root = tmp_path_factory.mktemp("export")
    solo = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    out = {}
    for name, overrides in VARIANTS.items():
        cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=32", "model.n_layers=2",
                                 "train.batch_size=4", "train.seq_len=16", "train.max_steps=3", "train.warmup_steps=1",
                                 "train.eval_interval=0", "train.eval_tokens=256", "monitor.tensorboard=false",
                                 "train.lr=0.02", *overrides])
        Trainer(cfg, root / name, solo, show_progress=False).run()
        export_run(root / name, root / f"{name}-hf")
        out[name] = (root / name, root / f"{name}-hf")
    return out


def tokens(model, eot: int, seed: int = 0) -> torch.Tensor:
    """Two rows of 24 tokens starting with the end-of-text token and holding no other one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=g)
    x[x == eot] = eot + 1
    x[:, 0] = eot
    return x


def assert_steps_are_the_specs(folder: Path, family: str) -> None:
    """The exported maths are rpt's spec files byte for byte: spec_cell.py the model's family's (rpt/ops/FAMILY/
    spec.py, which rpt's cell runs; no other family's ships), spec_stack.py and spec_loop.py the stack's and the
    loop's, each importing torch alone; modeling_rpt.py imports nothing else of its folder, names no family and
    writes no maths of its own (no gate, attention, MLP, softmax or loop injection: they come from the specs)."""
    ops = Path(rpt.__file__).parent / "ops"
    families = {p.parent.name for p in ops.glob("*/spec.py")} - {"stack", "loop"}
    assert families == {"lstm", "gru", "modlstm", "minrnn", "mlstm", "gdn"}
    shipped = {"spec_cell.py": ops / family / "spec.py", "spec_stack.py": ops / "stack" / "spec.py",
               "spec_loop.py": ops / "loop" / "spec.py"}
    assert {p.name for p in folder.glob("spec_*.py")} == set(shipped)
    for name, spec in shipped.items():
        assert (folder / name).read_bytes() == spec.read_bytes(), name
        tree = ast.parse(spec.read_text())
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {(node.module or ".").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported == {"torch"}, (spec, imported)
    modeling = (folder / "modeling_rpt.py").read_text()
    relative = {node.module for node in ast.walk(ast.parse(modeling)) if isinstance(node, ast.ImportFrom) and node.level}
    assert relative == {"configuration_rpt", "spec_cell", "spec_stack", "spec_loop"}, relative
    assert not [f for f in families if f"spec_{f}" in modeling or f"{f}_step" in modeling]
    maths = ("torch.sigmoid", "torch.tanh", "torch.exp(", "torch.clamp(", "scaled_dot_product_attention", "silu",
             "logsumexp", "log_softmax", "block_diag(")
    assert not [f for f in maths if f in modeling], "maths written in modeling_rpt.py instead of taken from a spec"


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_round_trip_gives_rpt_logits(runs, name):
    run, folder = runs[name]
    files = {p.name for p in folder.iterdir()}
    assert all((folder / f).stat().st_mode & 0o777 == (folder / "config.json").stat().st_mode & 0o777 for f in files)
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "modeling_rpt.py",
            "configuration_rpt.py"} <= files
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_rpt.RptForCausalLM"
    cfg, model, tokenizer, *_ = load_run(run, "best", "cpu")
    assert_steps_are_the_specs(folder, "minrnn" if cfg.model.cell in ("mingru", "minlstm") else cfg.model.cell)
    eot = tokenizer.token_to_id("<|endoftext|>")
    x = tokens(model, eot)
    hf = hf_model(folder)
    with torch.no_grad():
        ours, _ = model(x)
        theirs = hf(x).logits
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    # ... and back into rpt, as train.init_from reads an export: the same logits
    back = RecurrentLM(cfg.model)
    if cfg.model.head_shortlist:
        back.head.assign(torch.ones(cfg.model.vocab_size).numpy())  # another order, to be replaced by the export's
    load_weights(back, read_weights(folder), [], cfg.model.tie_embeddings, partial=False, tokenizer_sha256="")
    with torch.no_grad():
        again, _ = back.eval()(x)
    torch.testing.assert_close(again, ours, atol=1e-5 if cfg.model.weight_norm else 0, rtol=0)


def test_a_looped_export_gives_rpt_logits_at_every_depth_and_generates_at_one(runs):
    """num_steps (as Huginn's model takes it) is the looped model's depth: rpt's logits at depths 1, 4 and 7, in one
    forward and token by token through the cache; generate(num_steps=N) gives rpt's greedy tokens at depth N."""
    run, folder = runs["mingru-looped"]
    _, model, tokenizer, *_ = load_run(run, "best", "cpu")
    eot = tokenizer.token_to_id("<|endoftext|>")
    x = tokens(model, eot)
    hf = hf_model(folder)
    logits = {}
    for depth in (1, 4, 7):
        with torch.no_grad():
            ours, _ = model(x, depth=depth)
            theirs = hf(x, num_steps=depth).logits
            first = hf(x[:, :10], num_steps=depth)
            rest = hf(x[:, 10:], cache=first.cache, num_steps=depth).logits
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.cat([first.logits, rest], 1), ours, atol=1e-5, rtol=0)
        logits[depth] = ours
    assert (logits[1] - logits[7]).abs().max() > 1e-4  # the depth changes the model
    with torch.no_grad():
        greedy = hf.generate(x[:1, :8], max_new_tokens=6, do_sample=False, num_steps=4)[0, 8:].tolist()
    ours = list(Decoder(model).generate(x[0, :8], 6, temperature=0, reset_at=eot, depth=4))
    assert greedy == ours


def test_a_looped_export_refuses_a_depth_below_one_as_rpt_does(runs):
    """Before (issue 58): num_steps=0 silently ran the default depth, num_steps=-1 gave other logits, and a
    loop_depth of 0 in config.json (or lm-eval's model arguments) went unchecked."""
    run, folder = runs["mingru-looped"]
    hf = hf_model(folder)
    x = torch.zeros(1, 4, dtype=torch.long)
    for depth in (0, -1):
        with pytest.raises(ValueError, match=f"num_steps = {depth}: a looped model runs its core at least once"):
            hf(x, num_steps=depth)
        with pytest.raises(ValueError, match=f"loop_depth = {depth}: a looped model runs its core at least once"):
            transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, loop_depth=depth)
    with pytest.raises(ValueError, match="num_steps = 2 for a model without a loop"):
        hf_model(runs["lstm-attn"][1])(x, num_steps=2)
    card = (folder / "README.md").read_text()
    assert "num_steps" in card and "looped core" in card and "loop_depth=8" in card
    assert "num_steps" not in (runs["lstm-attn"][1] / "README.md").read_text()


def test_exported_model_resets_at_end_of_text_as_rpt_evaluates(runs):
    run, folder = runs["lstm-attn"]
    _, model, tokenizer, *_ = load_run(run, "best", "cpu")
    eot = tokenizer.token_to_id("<|endoftext|>")
    x = tokens(model, eot)
    x[0, 10] = x[1, 17] = eot  # documents start inside the rows
    with torch.no_grad():
        ours, _ = model(x, reset_mask=x == eot)
        plain, _ = model(x)
        theirs = hf_model(folder)(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (theirs - plain).abs().max() > 1e-3  # the resets matter here


def test_tokenizer_loads_and_a_fresh_row_reads_as_a_document(runs):
    run, folder = runs["lstm-attn"]
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False)  # no code of ours needed
    _, model, tokenizer, *_ = load_run(run, "best", "cpu")
    text = "First Citizen: before we proceed"
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = tok(text).input_ids
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids and eot not in ids
    assert tok.eos_token_id == eot and tok.decode(ids) == text
    # a row without the end-of-text token reads as rpt reads the document (after that token); with it, the same
    hf = hf_model(folder)
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, _ = model(torch.cat([torch.tensor([[eot]]), x], 1))
        torch.testing.assert_close(hf(x).logits, ours[:, 1:], atol=1e-5, rtol=0)
        torch.testing.assert_close(hf(torch.cat([torch.tensor([[eot]]), x], 1)).logits, ours, atol=1e-5, rtol=0)
        plain, _ = model(x)
    assert (plain - ours[:, 1:]).abs().max() > 1e-3  # rpt's raw forward from a zero state differs


@pytest.mark.parametrize("name", ["lstm-attn", "modlstm-exp", "mingru-short"])
def test_transformers_greedy_generate_equals_rpt_generate(runs, name, tmp_path):
    run, folder = runs[name]
    cfg, model, tokenizer, *_ = load_run(run, "best", "cpu")
    with torch.no_grad():  # weights far from a few steps' training, whose greedy text is one token repeated
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    folder = tmp_path / "hf"
    export_model(cfg, model, run / "tokenizer.json", folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok("Is it a verdict?", return_tensors="pt").input_ids
    eot = torch.tensor([[tok.eos_token_id]])
    ours = list(Decoder(model).generate(torch.cat([eot, ids], 1)[0], 30, temperature=0, reset_at=int(eot)))  # as rpt generate
    hf = hf_model(folder)
    out = hf.generate(ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert out.sequences[0, ids.shape[1]:].tolist() == ours
    # every step's logits through the cache equal rpt's forward over the whole text
    with torch.no_grad():
        whole, _ = model(torch.cat([eot, out.sequences[:, :-1]], 1))
    torch.testing.assert_close(torch.cat(out.logits), whole[0, ids.shape[1]:], atol=1e-5, rtol=1e-5)  # logits ~10
    # the cache is the recurrent state: its size does not grow with the tokens generated
    short = hf.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    size = lambda cache: sum(t.numel() for t in _tensors(cache.blocks))
    assert size(out.cache) == size(short.cache) > 0
    assert out.cache.seen == ids.shape[1] + 29


def test_exports_of_two_families_in_one_process_keep_their_own_cells(runs, tmp_path):
    """transformers gives a config class it has seen the model class it first loaded with it: exports of two
    families into folders of the same name (the same configuration file but for the code hash the export writes)
    would otherwise share the first one's cell."""
    cells = {}
    for name in ("lstm-attn", "mlstm"):
        run, _ = runs[name]
        cfg, model, *_ = load_run(run, "best", "cpu")
        folder = tmp_path / name / "hf"
        export_model(cfg, model, run / "tokenizer.json", folder)
        hf = hf_model(folder)
        cells[name] = {n for n, _ in hf.blocks["0"].cell.named_parameters()}
        assert cells[name] == {n.removeprefix("blocks.0.cell.") for n in model.state_dict() if n.startswith("blocks.0.cell.")}
    assert cells["lstm-attn"] != cells["mlstm"]


def test_left_padded_batch_scores_and_generates_as_each_row_alone(runs):
    _, folder = runs["lstm-attn"]
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    tok.padding_side = "left"
    hf = hf_model(folder)
    prompts = ["Is it a verdict?", "We are accounted poor citizens, the patricians good."]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()
    together = hf.generate(**batch, max_new_tokens=12, do_sample=False)[:, batch.input_ids.shape[1]:]
    with torch.no_grad():
        last = hf(**batch).logits[:, -1]
    for row, prompt in enumerate(prompts):
        alone = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            torch.testing.assert_close(last[row], hf(alone).logits[0, -1], atol=1e-5, rtol=0)
        assert together[row].tolist() == hf.generate(alone, max_new_tokens=12, do_sample=False)[0, alone.shape[1]:].tolist()


def test_large_weights_are_sharded_and_load_back(runs, tmp_path):
    run, folder = runs["gru-untied"]
    sharded = tmp_path / "sharded"
    export_run(run, sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    whole, parts = read_weights(folder).tensors, read_weights(sharded).tensors
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
    a, b = hf_model(sharded), hf_model(folder)
    loaded_a, loaded_b = a.state_dict(), b.state_dict()  # the claim: the same weights, bit for bit, once loaded
    assert loaded_a.keys() == loaded_b.keys() and all(torch.equal(loaded_a[k], loaded_b[k]) for k in loaded_a)
    x = torch.arange(20)[None] % 300
    with torch.no_grad():  # two forwards may sum in another order on a loaded machine's threads
        torch.testing.assert_close(a(x).logits, b(x).logits, atol=1e-6, rtol=0)


def test_bad_exports_get_one_clear_message(runs, tmp_path, tiny_data, monkeypatch):
    run, folder = runs["lstm-attn"]
    from rpt.models.registry import CELLS
    monkeypatch.setattr(CELLS["lstm"], "export_spec", None)  # as a user's cell that names no exported step
    with pytest.raises(RptError, match="lstm' has no exported step.*gru"):
        export_run(run, tmp_path / "cell")
    monkeypatch.undo()
    with pytest.raises(RptError, match="exists and is not empty"):
        export_run(run, folder)
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    (empty / "config.toml").write_text((run / "config.toml").read_text())
    with pytest.raises(RptError, match="no complete checkpoint"):
        export_run(empty, tmp_path / "out")
    with pytest.raises(RptError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "out2")
    assert not any((tmp_path / name).exists() for name in ("out", "out2", "cell"))


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, (list, tuple)):
        for s in state:
            yield from _tensors(s)


def test_the_modeling_files_need_only_torch_and_transformers():
    """What `rpt export` copies beside the weights imports nothing of rpt (it runs where rpt is not installed)."""
    import ast
    import sys

    import rpt.export.hf as hf_code

    allowed = {"torch", "transformers", *sys.stdlib_module_names}
    for path in Path(hf_code.__file__).parent.glob("*_rpt.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [] if node.level else [node.module.split(".")[0]]  # a relative import: the other file
            else:
                continue
            assert set(roots) <= allowed, f"{path.name} imports {roots}"


SEPARATOR = "----- the next snippet -----"


def test_the_loading_snippets_of_the_docs_and_the_model_card_run_as_written(runs):
    """docs/models.md's snippet and the exported README's, pasted into Python with nothing to answer (stdin closed):
    they load, generate and print, and transformers asks no question."""
    import re
    import subprocess
    import sys

    _, folder = runs["lstm-attn"]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    card = (folder / "README.md").read_text()
    snippets = [next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "AutoTokenizer" in b)
                for text in (docs, card)]
    snippets = [snippets[0].replace('"exports/NAME"', repr(str(folder))),
                f"DIR = {str(folder)!r}\n" + snippets[1]]
    # both in one process (transformers' import is most of its time), each with globals of its own
    code = "\n".join(f"exec({snippet!r}, {{}})\nprint({SEPARATOR!r})" for snippet in snippets)
    done = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    printed = done.stdout.split(SEPARATOR + "\n")
    assert len(printed) == 3 and printed[2] == ""
    for out in printed[:2]:
        assert out.startswith("def main(")  # the prompt, and what the model made of it
