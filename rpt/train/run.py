"""Run directories, each rank's log (RUN_DIR/logs/rank{R}.log; rank 0 also talks to the terminal), and the entry
points behind `rpt eval` and `rpt generate`. `rpt train`'s is rpt.train.trainer.train.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import sys
from datetime import datetime
from pathlib import Path

import torch

from rpt.config import Config
from rpt.errors import RptError
from rpt.models.loop_exit import Exit
from rpt.parallel import launch
from rpt.runtime import keep_freed_memory


def default_run_dir(config_path: str | None) -> Path:
    name = Path(config_path).stem if config_path else "default"
    return Path("runs") / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


class _LazyFileHandler(logging.FileHandler):
    """Creates its folder and file with the first record: a run refused at start leaves no run directory."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def setup_logging(run_dir: Path, rank: int) -> None:
    handler = _LazyFileHandler(run_dir / "logs" / f"rank{rank}.log", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("rpt")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def load_run(run_dir: str | Path, checkpoint: str = "best", device: str | None = None):
    """(config, model with weights, tokenizer, checkpoint path, its CheckpointStore) of a finished or running run."""
    from rpt.data.tokenizer import load_tokenizer
    from rpt.models import RecurrentLM
    from rpt.train.checkpoint_store import CheckpointStore

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise RptError(f"{run_dir} is not a run directory (no config.toml)", "pass the folder `rpt train` wrote, e.g. runs/NAME")
    cfg = Config.load(run_dir / "config.toml")
    dev = launch.pick_device(device, 0)
    model = RecurrentLM(cfg.model).to(dev)
    ck = CheckpointStore(cfg.checkpoint.path or str(run_dir / "checkpoints"))
    path = ck.resolve(checkpoint, str(run_dir))
    for damaged, problem in ck.damaged.items():
        print(f"skipping the damaged checkpoint {damaged}: {problem}", file=sys.stderr)
    ck.load(path, model)
    model.eval()
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    return cfg, model, tokenizer, path, ck


def eval_run(run_dir: str, checkpoint: str, device: str | None, data_path: str | None,
             depth: int | None = None, by_position: bool = False) -> dict:
    """Validation of a run's checkpoint (a looped model at `depth` iterations, its loop_mean where None; with
    `by_position`, also by the position of each token in its document)."""
    from rpt.data.dataset import PreparedData
    from rpt.data.mixture import open_dataset
    from rpt.data.tokenizer import token_byte_lengths
    from rpt.train.evaluate import evaluate

    keep_freed_memory()
    cfg, model, tokenizer, path, ck = load_run(run_dir, checkpoint, device)
    depth = check_depth(cfg.model, depth)
    if cfg.train.bptt_chunk:  # a long window's losses a chunk at a time, as its validations computed them
        from rpt.parallel.bptt import chunk_windows

        chunk_windows(model, cfg.train.bptt_chunk)
    data = PreparedData(data_path) if data_path else open_dataset(cfg.data)
    if data.meta["tokenizer_sha256"] != json.loads((Path(run_dir) / "meta.json").read_text())["tokenizer_sha256"]:
        raise RptError(f"the data at {data.path} was tokenized with another tokenizer than the run's",
                       "evaluate on data prepared with the run's tokenizer (rpt prepare --tokenizer RUN_DIR/tokenizer.json)")
    dev = next(model.parameters()).device
    result = evaluate(model, data.tokens("val"), token_byte_lengths(tokenizer), batch_size=cfg.train.batch_size,
                      seq_len=cfg.train.seq_len, device=dev,
                      eot_id=data.eot_id if cfg.data.reset_at_documents else None, depth=depth,
                      by_position=by_position)
    about = ck.describe(path)
    return {**result, "depth": depth, "checkpoint": path, "about": f"{checkpoint}: {about}" if checkpoint in ("best", "latest") else about}


def check_depth(m, depth: int | None) -> int | None:
    """The test-time depth of a looped model: `depth`, or its loop_mean (rounded) where None; refused for a model
    without a loop, below 1, and above DEPTH_FACTOR x the most it trained at."""
    if depth is None:
        return round(m.loop_mean) if m.loop_core else None
    if not m.loop_core:
        raise RptError(f"--depth {depth} for a model without a loop (model.loop_core = 0)",
                       "leave out --depth: only a looped model (docs/depth.md) runs at a chosen depth")
    if depth < 1:
        raise RptError(f"--depth {depth}: a looped model runs its core at least once",
                       f"use --depth 1 or more (its training mean was {m.loop_mean:g})")
    if depth > DEPTH_FACTOR * m.loop_cap:
        raise RptError(f"--depth {depth:,}: more than {DEPTH_FACTOR} x the most iterations the model trained at "
                       f"(model.loop_max = {m.loop_cap}); each costs a pass of the core a token, and each one beyond "
                       f"{m.loop_cap} a state of its own", f"use --depth {DEPTH_FACTOR * m.loop_cap} or less (its "
                       f"training mean was {m.loop_mean:g}; a looped model's gains end well before)")
    return depth


DEPTH_FACTOR = 4  # the deepest test-time depth: this many times the most iterations the model trained at (loop_max)


def generate_text(run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  seed: int | None, checkpoint: str, device: str | None, out=None,
                  depth: int | None = None, exit: str | None = None, shared: bool = False) -> str:
    """Stream the prompt, then the generated text as it is sampled, to `out`; returns the generated text. `depth`:
    a looped model's iterations per token; `exit` ("kl:5e-4"): end them early, at most `depth` (4 x loop_mean by
    default); `shared`: keep one state for all iterations (rpt/models/loop_exit.py, docs/depth.md)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    out = out or sys.stdout  # (the stream of the moment, not the one of the import)
    from rpt.data.tokenizer import eot_id, token_bytes
    from rpt import kernels
    from rpt.kernels.cpu.products import generating

    rule = Exit.parse(exit) if exit else None
    cfg, model, tokenizer, _, _ = load_run(run_dir, checkpoint, device)
    if (rule or shared) and not cfg.model.loop_core:
        raise RptError(f"{'--exit' if rule else '--shared-state'} for a model without a loop (model.loop_core = 0)",
                       "leave it out: only a looped model (docs/depth.md) has iterations to end or share")
    if rule is not None:
        rule.check(cfg.model)
    depth = check_depth(cfg.model, depth if depth is not None or rule is None else 4 * round(cfg.model.loop_mean))
    dev = next(model.parameters()).device
    ids = [eot_id(tokenizer)] + tokenizer.encode(prompt, add_special_tokens=False).ids  # a document starts with EOT
    table = token_bytes(tokenizer)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")  # whole characters only: a sampled token
    # may begin or end inside a character, and its lone bytes would print as U+FFFD
    generator = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    pieces = []
    tokens = model.generate(torch.tensor(ids, device=dev), max_new_tokens, temperature, top_k, top_p, generator,
                            reset_at=ids[0] if cfg.data.reset_at_documents else None, depth=depth, exit=rule,
                            shared=shared)
    if dev.type == "cpu":  # each step's one-row products on rpt's small-batch product
        tokens = generating(model, tokens, kernels.current())
    first = next(tokens, None)  # the prompt's forward first: a first use's build message comes before any text
    out.write(prompt)
    for token in [] if first is None else itertools.chain([first], tokens):
        text = decoder.decode(table[token])
        if text:
            pieces.append(text)
            out.write(text)
            out.flush()
    tail = decoder.decode(b"", final=True)
    out.write(tail + "\n")
    if rule is not None:
        print(f"(--exit {exit}: {rule.mean_depth:.2f} iterations a token on average, at most {depth})",
              file=sys.stderr)
    return "".join(pieces) + tail


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Refuse sampling settings that mean nothing, before the model is loaded."""
    if max_new_tokens < 0:
        raise RptError(f"--max-new-tokens {max_new_tokens} is negative", "e.g. --max-new-tokens 200")
    if not temperature >= 0:
        raise RptError(f"--temperature {temperature} is negative", "use 0 for the most likely token each time, "
                       "or a positive value such as 0.8 (higher: more varied text)")
    if top_k < 0:
        raise RptError(f"--top-k {top_k} is negative", "use 0 for no limit, or e.g. 50")
    if not 0 < top_p <= 1:
        raise RptError(f"--top-p {top_p} is outside (0, 1]", "it is a share of the probability mass: use e.g. 0.95, "
                       "or 1 for no limit")
