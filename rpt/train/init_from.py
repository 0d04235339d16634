"""`train.init_from = PATH`: a new run that starts from earlier weights, with a fresh optimiser, schedule and loader.

PATH is a run directory (its best checkpoint), one checkpoint folder (RUN/checkpoints/step_N), or a folder that
`rpt export` wrote. `train.init_fresh = ["head"]` (or `["embed", "head"]` for a new vocabulary) leaves those
parts at their fresh initialisation. The weights go in through torch's `set_model_state_dict` from full tensors,
so the same code loads a whole model, a pipeline stage (it takes the keys it holds) or an FSDP2-sharded one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from rpt.errors import RptError
from rpt.train.checkpoint.store import MANIFEST, CheckpointStore

WN = ".parametrizations."  # weight normalisation's keys: X.parametrizations.NAME.original0 (g) / original1 (v)


@dataclass
class Weights:
    tensors: dict[str, torch.Tensor]
    tokenizer_sha256: str  # of the tokenizer the weights were trained with ("" when unknown)
    source: str  # where they came from, for messages


def read_weights(path: str | Path) -> Weights:
    """The model weights at `path`, as full tensors on the CPU."""
    from rpt.config import Config

    p = Path(path)
    if (p / "config.toml").is_file():
        cfg = Config.load(p / "config.toml")
        ck = CheckpointStore(cfg.checkpoint.path or str(p / "checkpoints"))
        found = ck.find("best", str(p))
        return Weights(ck.read_model(found), run_tokenizer_sha256(p), found)
    if (p / MANIFEST).is_file():
        ck = CheckpointStore(str(p.parent))
        found = ck.find(str(p), str(p.parent))
        return Weights(ck.read_model(found), run_tokenizer_sha256(p.parent.parent), found)
    if is_export(p):
        return Weights(_read_safetensors(p), json.loads((p / "config.json").read_text()).get("tokenizer_sha256", ""),
                       str(p))
    raise RptError(f"train.init_from = {path} is not a run directory, a checkpoint folder or an rpt export",
                   "point it at a folder `rpt train` wrote (runs/NAME), one of its checkpoints/step_N, or a folder "
                   "that `rpt export` wrote")


def is_export(folder: Path) -> bool:
    """Whether `folder` is one `rpt export` wrote (its config.json names model_type "rpt")."""
    config = folder / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "rpt"


def run_tokenizer_sha256(run_dir: Path) -> str:
    """The sha256 of the tokenizer a run trained with (its meta.json), "" when unknown."""
    meta = run_dir / "meta.json"
    return json.loads(meta.read_text()).get("tokenizer_sha256", "") if meta.is_file() else ""


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for name in files:
        if not (folder / name).is_file():
            raise RptError(f"{folder} lacks {name}", "export the run again with rpt export")
        tensors.update(load_file(str(folder / name)))
    return tensors


def load_weights(model: torch.nn.Module, weights: Weights, fresh: list[str], tie_embeddings: bool,
                 partial: bool, tokenizer_sha256: str) -> list[str]:
    """Load `weights` into `model` (a whole model, a stage when `partial`), leaving the parts named in `fresh`
    as they are; refuses, listing every key, when shapes differ. Returns the keys loaded."""
    fresh = set(fresh)
    if tie_embeddings and fresh & {"embed", "head"}:
        fresh |= {"embed", "head"}  # one matrix
    new_vocabulary = {"embed", "head"} <= fresh
    if weights.tokenizer_sha256 and tokenizer_sha256 and weights.tokenizer_sha256 != tokenizer_sha256 and not new_vocabulary:
        raise RptError(f"train.init_from: {weights.source} was trained with another tokenizer than this run's data",
                       "prepare the data with its tokenizer (rpt prepare --tokenizer RUN/tokenizer.json), or start the "
                       "embedding and head fresh: train.init_fresh = [\"embed\", \"head\"]")
    target = get_model_state_dict(model)
    skip = lambda key: key.split(".", 1)[0] in fresh
    source = _as_target(dict(weights.tensors), target, tie_embeddings)
    problems = []
    for key, tensor in target.items():
        if skip(key):
            continue
        if key not in source:
            problems.append(f"{key}: not in {weights.source}")
        elif tuple(source[key].shape) != tuple(tensor.shape):
            problems.append(f"{key}: {tuple(source[key].shape)} there, {tuple(tensor.shape)} in this model")
    if not partial:
        problems += [f"{key}: in {weights.source}, not in this model" for key in source if key not in target and not skip(key)]
    if problems:
        listed = "\n    ".join(problems[:20]) + (f"\n    ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise RptError(f"train.init_from: the weights do not fit this model:\n    {listed}",
                       "use the model settings of that run, or start the differing parts fresh with train.init_fresh "
                       "(e.g. [\"head\"], or [\"embed\", \"head\"] for a new vocabulary)")
    loaded = {k: source[k].to(target[k].dtype) for k in target if not skip(k)}
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True, strict=False))
    return sorted(loaded)


def _as_target(source: dict, target: dict, tie_embeddings: bool) -> dict:
    """The source's tensors under the target's names: the tied head's matrix from the embedding (an export keeps
    one copy), and weight normalisation's (g, v) from a plain matrix or the matrix from (g, v)."""
    if tie_embeddings and "head.weight" in target and "head.weight" not in source and "embed.weight" in source:
        source["head.weight"] = source["embed.weight"]
    consumed = set()
    for key in target:
        if WN in key and key not in source:
            module, rest = key.split(WN)
            name, part = rest.split(".")
            plain = source.get(f"{module}.{name}")
            if plain is not None:  # g = |w| per row, v = w: the same weight
                source[key] = plain.flatten(1).norm(dim=1).view(-1, *[1] * (plain.dim() - 1)) if part == "original0" else plain
                consumed.add(f"{module}.{name}")
        elif key not in source and f"{key.rsplit('.', 1)[0]}{WN}{key.rsplit('.', 1)[1]}.original0" in source:
            module, name = key.rsplit(".", 1)
            g, v = source[f"{module}{WN}{name}.original0"], source[f"{module}{WN}{name}.original1"]
            source[key] = g * v / v.flatten(1).norm(dim=1).view_as(g)
            consumed |= {f"{module}{WN}{name}.original0", f"{module}{WN}{name}.original1"}
    return {k: v for k, v in source.items() if k not in consumed or k in target}
