"""A run's configuration, resolved once: the user's configuration (Config.load: frozen) against the data and the
world, into an immutable ResolvedRun that everything after it reads and nothing changes.

    the default recipe's choices       train.recipe = "auto" (rpt/train/recipe.py), for the keys nobody gave
    the vocabulary                     model.vocab_size = 0: the data's (meta.json); token ids checked to fit
    the layout                         parallel.pp / fsdp "auto": the plan (rpt/parallel/plan.py), costs timed here
    the communication                  comm.mode "auto": the links measured and each mode timed (rpt/comm/modes.py);
                                       a mesh or a job of CPU and GPU ranks leaves all-reduce
    every check that spans sections    `check` (each section checks its own values when it is loaded)

Each value records where it came from (`Config.origins`: a file, --set, the recipe, the data, a measurement;
absent: the default), and the run directory's config.toml says so beside each value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rpt.config import Config
from rpt.data.dataset import PreparedData
from rpt.data.mixture import MixedData, open_dataset
from rpt.errors import RptError
from rpt.data.dataset import token_counts
from rpt.parallel.launch import Dist
from rpt.train.init_from import run_tokenizer_sha256

FROM_DATA, MEASURED = "the data (meta.json)", "measured at start"


@dataclass(frozen=True)
class ResolvedRun:
    """What a run trains with: `cfg` frozen, every `auto` and 0-means-the-data resolved."""
    cfg: Config
    notes: tuple[str, ...]  # what loading and resolving chose or warn of, said at start
    recipe_seconds: float  # what the default recipe took (0 without it)
    plan: object | None  # the pipeline / FSDP plan (rpt.parallel.plan.Plan); None for plain data parallelism
    comm_choice: dict | None  # comm.mode = "auto": the seconds per step it chose by (modelled and timed)

    def to_toml(self) -> str:
        """config.toml of the run directory: Config.load reads it back; each value's origin in a comment."""
        return self.cfg.to_toml(origins=True)


def resolve(cfg: Config, d: Dist, run_dir: Path, resume: bool = False,
            restarted: bool = False) -> tuple[ResolvedRun, PreparedData | MixedData]:
    """Resolve `cfg` alike on every rank of this job (the measurements are collectives); the run and its data.
    `resume`: --resume (cfg is the run's config.toml, with any --set); `restarted`: an elastic restart of this
    job, which takes the choices the run made at its start from its config.toml."""
    work, recipe_seconds = cfg.thawed(), 0.0
    if work.train.recipe == "auto" and not resume:
        if restarted and (run_dir / "config.toml").is_file():  # the choices this run made at its start
            work = Config.load(run_dir / "config.toml", run_file=True).thawed()
        else:
            recipe_seconds = _apply_recipe(work, d)
    check_world(work, d)
    data = open_data(work, run_dir if resume or restarted else None)
    plan = _resolve_layout(work, d)
    comm_choice = resolve_comm(work, d, plan)
    work.validate()  # each section again, with what resolving set (a shortlist against the data's vocabulary)
    check(work)
    notes = tuple(work.notes)
    return ResolvedRun(work.freeze(), notes, recipe_seconds, plan, comm_choice), data


def _apply_recipe(cfg: Config, d: Dist) -> float:
    """The default recipe, from the prepared data's token counts (rpt/train/recipe.py); the seconds it took."""
    from rpt.train.recipe import apply_recipe

    data = open_dataset(cfg.data)
    train_tokens, val_tokens = data.tokens("train"), data.tokens("val")
    counts = token_counts(train_tokens, cfg.model.vocab_size or data.vocab_size)
    return apply_recipe(cfg, d, len(train_tokens), len(val_tokens), counts)


def open_data(cfg: Config, resumed: Path | None = None) -> PreparedData | MixedData:
    """The prepared data of data.path (or the mixture of data.mix), its vocabulary given to the model
    (model.vocab_size = 0) or checked against it, and every token id of both splits checked to fit; for a
    `resumed` run, its tokenizer checked to be the one the run trained with."""
    data = open_dataset(cfg.data)
    theirs, ours = (run_tokenizer_sha256(resumed) if resumed else ""), data.meta.get("tokenizer_sha256", "")
    if theirs and ours and theirs != ours:
        raise RptError(f"{cfg.data.path if not cfg.data.mix else 'data.mix'} was prepared with another tokenizer "
                       f"than the one the run {resumed} trained with: its token ids mean other text",
                       f"resume on data prepared with the run's tokenizer (rpt prepare --input ... --out DIR "
                       f"--tokenizer {resumed}/tokenizer.json), or start a new run from its weights with "
                       f"train.init_from = {resumed}")
    if cfg.model.vocab_size == 0:
        cfg.set("model.vocab_size", data.vocab_size, origin=FROM_DATA)
    elif cfg.model.vocab_size < data.vocab_size:
        raise RptError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the data's vocabulary "
                       f"({data.vocab_size})", "set model.vocab_size = 0 to take it from the data")
    for split in ("train", "val"):
        data.check_ids(split, cfg.model.vocab_size)
    return data


def _resolve_layout(cfg: Config, d: Dist):
    """The plan for pipeline stages or FSDP shards (None for plain data parallelism); "auto" degrees resolved."""
    from rpt.parallel.apply import choose_layout

    p = cfg.parallel
    plan = choose_layout(cfg, d.rank, d.world_size, d.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    for key, value in (("pp", plan.pp if plan else 1), ("fsdp", plan.fsdp if plan else 1)):
        if getattr(p, key) == "auto":
            cfg.set(f"parallel.{key}", value, origin=f"{MEASURED} (rpt plan)")
    return plan


def resolve_comm(cfg: Config, d: Dist, plan) -> dict | None:
    """comm.mode = "auto" on several data-parallel ranks: the mode (and codec) the measured links make fastest;
    all-reduce in a pipeline or FSDP mesh (the links are measured over the whole world, not per dp group) and in a
    job of CPU and GPU ranks (gloo's CUDA support is all-reduce and broadcast). One process leaves it as given."""
    if cfg.comm.mode != "auto":
        return None
    if d.mixed_devices:
        cfg.set("comm.mode", "allreduce", origin="a job of CPU and GPU ranks: all-reduce is the only mode there")
        return None
    if not d.enabled or d.world_size == 1:
        return None
    if plan is not None:
        cfg.set("comm.mode", "allreduce", origin="a pipeline or FSDP mesh: all-reduce over its data-parallel ranks")
        return None
    if cfg.parallel.cp != 1:
        cfg.set("comm.mode", "allreduce", origin="context parallelism: all-reduce over every rank")
        return None
    from rpt.comm.modes import choose_mode
    from rpt.parallel.plan import gradient_bytes

    mode, codec, choice = choose_mode(gradient_bytes(cfg), cfg.comm, cfg.train.precision)
    cfg.set("comm.mode", mode, origin=MEASURED)
    if codec != cfg.comm.compression:
        cfg.set("comm.compression", codec, origin=MEASURED)
    return choice


def check_world(cfg: Config, d: Dist) -> None:
    """What the ranks of this job can form: a pipeline degree that divides them, and what a job of CPU and GPU
    ranks (gloo for all, whose CUDA support is all-reduce and broadcast) can carry."""
    check_layout(cfg, d.world_size)
    if not d.mixed_devices:
        return
    c, pp = cfg.comm, cfg.parallel.pp
    uses = [what for what, on in (("comm.mode = " + repr(c.mode), c.mode in ("ps", "ps-sharded")),
                                  ("comm.compression = 'int8'", c.compression == "int8"),
                                  ("comm.compression = 'topk'", c.compression == "topk"),
                                  (f"parallel.pp = {pp}", pp != 1)) if on]
    if uses:
        raise RptError(f"this job mixes CPU and GPU ranks (gloo for all), which cannot carry {', '.join(uses)}",
                       "run every rank on one kind of device (--device cpu on all, or GPUs on all), or use "
                       "comm.mode = 'allreduce' with compression none, fp16, bf16 or powersgd and parallel.pp = 1")


def check_layout(cfg: Config, world_size: int) -> None:
    """Refuse, before anything is built or written, a pipeline or context degree the ranks cannot form."""
    pp, cp = cfg.parallel.pp, cfg.parallel.cp
    if world_size % cp:
        raise RptError(f"world size {world_size} is not divisible by parallel.cp = {cp}",
                       f"run a multiple of {cp} ranks (e.g. --nproc {cp * max(1, world_size // cp)}), "
                       "or choose a parallel.cp that divides the world size")
    if pp != "auto" and world_size % int(pp):
        raise RptError(f"world size {world_size} is not divisible by parallel.pp = {pp}",
                       f"run a multiple of {pp} ranks (e.g. --nproc {pp * max(1, world_size // int(pp))}), "
                       "or choose a parallel.pp that divides the world size")


def check(cfg: Config) -> None:
    """Refuse the combinations of sections that cannot work, naming the fix (each section's own values were
    checked when it was loaded). Every command runs this (rpt.cli.load_config), and every run after resolving."""
    m, t, p, c = cfg.model, cfg.train, cfg.parallel, cfg.comm
    if isinstance(p.pp, int) and p.pp > m.n_layers:
        raise RptError(f"parallel.pp = {p.pp} is larger than model.n_layers = {m.n_layers}: "
                       "a pipeline stage needs at least one block", f"use parallel.pp <= {m.n_layers}, or more layers")
    if p.schedule == "interleaved" and p.pp * p.stages_per_rank > m.n_layers:
        raise RptError(f"parallel.pp x stages_per_rank = {p.pp * p.stages_per_rank} virtual stages, but "
                       f"model.n_layers = {m.n_layers}: each needs at least one block",
                       "use fewer stages_per_rank, a smaller pp, or more layers")
    if m.loop_core:
        m.check()  # the loop's keys against n_layers, which a recipe may have chosen
    elif t.eval_depths:
        raise RptError(f"train.eval_depths = {t.eval_depths} for a model without a loop (model.loop_core = 0)",
                       "leave train.eval_depths empty, or loop the model (docs/depth.md)")
    if p.pp != 1:
        _check_pipeline(cfg)
    if p.cp != 1:
        _check_context(cfg)
    if p.fsdp != 1:
        if c.mode not in ("allreduce", "auto") or c.compression != "none" or c.adaptive:
            raise RptError(f"parallel.fsdp = {p.fsdp!r} with comm.mode = '{c.mode}', compression = "
                           f"'{c.compression}'" + (", adaptive" if c.adaptive else "") + ": FSDP reduce-scatters "
                           "the gradients itself (the parameter servers shard them another way; codecs and the "
                           "adaptive schedule hook into DDP, which FSDP replaces)",
                           "use comm.mode = 'allreduce' and compression 'none' with FSDP, or parallel.fsdp = 1")
        if t.precision == "fp16":
            raise RptError(f"train.precision = 'fp16' with parallel.fsdp = {p.fsdp!r}: loss scaling over "
                           "sharded gradients is not built", "use precision bf16 (no loss scaling) or fp32")
    if t.batch_size % p.microbatches:
        raise RptError(f"train.batch_size = {t.batch_size} is not divisible by parallel.microbatches = "
                       f"{p.microbatches}", "choose a micro-batch count that divides the batch size")
    _check_comm(cfg)
    _check_builds(cfg)


def _check_builds(cfg: Config) -> None:
    """The model built on the meta device (no memory, no initialisation): what its construction refuses (a head
    count that does not divide a cell's state, ...) every command refuses on loading, `rpt config` as `rpt train`.
    A vocabulary the data gives (0) is built at 65,536, above any shortlist a head may ask for."""
    import dataclasses

    from rpt.models.lm import RecurrentLM
    from rpt.models.shapes import on_meta

    m = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=65536)
    with on_meta():
        RecurrentLM(m)


def _check_pipeline(cfg: Config) -> None:
    t, p, c = cfg.train, cfg.parallel, cfg.comm
    if t.bptt_chunk:
        raise RptError(f"train.bptt_chunk = {t.bptt_chunk} with parallel.pp = {p.pp}: a pipeline stage's window is "
                       "not recomputed in chunks yet", "use parallel.pp = 1 with train.bptt_chunk (FSDP shards a "
                       "model too large for one device), or train.bptt_chunk = 0 with a pipeline")
    if c.mode in ("ps", "ps-sharded", "diloco"):
        raise RptError(f"comm.mode = '{c.mode}' with parallel.pp = {p.pp}: the parameter servers and DiLoCo do not "
                       "run over a pipeline's data-parallel dimension yet",
                       "use comm.mode = 'allreduce' (any compression, adaptive too) with a pipeline")
    if t.precision == "fp16":
        raise RptError(f"train.precision = 'fp16' with parallel.pp = {p.pp}: loss scaling across pipeline "
                       "stages is not built", "use precision bf16 (no loss scaling needed) or fp32")
    if t.grad_accum != 1:
        raise RptError(f"train.grad_accum = {t.grad_accum} with parallel.pp = {p.pp}: the pipeline's "
                       "micro-batches are its gradient accumulation",
                       "set train.grad_accum = 1 and parallel.microbatches to the micro-batch count")


def _check_context(cfg: Config) -> None:
    """Context parallelism (rpt/parallel/context.py): a window its ranks can split, beside data parallelism only."""
    m, t, p, c = cfg.model, cfg.train, cfg.parallel, cfg.comm
    piece = t.seq_len // p.cp
    if t.seq_len % p.cp:
        raise RptError(f"train.seq_len = {t.seq_len} is not divisible by parallel.cp = {p.cp}",
                       f"use a window that splits evenly, e.g. train.seq_len = {max(1, piece) * p.cp}")
    if m.attention_every and piece < m.attention_window:
        raise RptError(f"parallel.cp = {p.cp} splits train.seq_len = {t.seq_len} into pieces of {piece} tokens, "
                       f"shorter than model.attention_window = {m.attention_window}",
                       f"use train.seq_len >= {p.cp * m.attention_window}, or a smaller cp or attention window")
    joined = [what for what, on in ((f"parallel.pp = {p.pp}", p.pp != 1), (f"parallel.fsdp = {p.fsdp}", p.fsdp != 1),
                                    (f"model.loop_core = {m.loop_core}", bool(m.loop_core)),
                                    (f"train.bptt_chunk = {t.bptt_chunk}", bool(t.bptt_chunk)),
                                    ("model.activation_checkpointing", m.activation_checkpointing),
                                    (f"train.compile = {t.compile!r}", bool(t.compile)),
                                    (f"comm.mode = '{c.mode}'", c.mode not in ("allreduce", "auto")),
                                    ("comm.adaptive", c.adaptive)) if on]
    if joined:
        raise RptError(f"parallel.cp = {p.cp} with {', '.join(joined)}: context parallelism runs beside data "
                       "parallelism (all-reduce) only; the others recompute or re-split a forward whose pieces "
                       "exchange states with other ranks", "drop them, or use train.bptt_chunk alone for a long "
                       "window on one rank (docs/long-sequences.md)")


def _check_comm(cfg: Config) -> None:
    t, c = cfg.train, cfg.comm
    if c.mode == "diloco" and t.average:
        raise RptError("train.average with comm.mode = 'diloco': DiLoCo's replicas differ between outer steps, "
                       "so their averages would too", "set train.average = 0 with diloco")
    if c.mode == "diloco" and t.eval_interval % c.diloco_steps:
        raise RptError(f"train.eval_interval = {t.eval_interval} with comm.mode = 'diloco' and comm.diloco_steps = "
                       f"{c.diloco_steps}: the replicas agree only at outer steps, where validation must fall",
                       f"use a multiple of {c.diloco_steps} (or 0) for train.eval_interval")
    if t.precision == "fp16" and c.mode in ("ps", "ps-sharded"):
        raise RptError(f"train.precision = 'fp16' with comm.mode = '{c.mode}': the loss scaler's overflow check "
                       "needs every gradient on every rank, which a parameter server does not keep",
                       "use train.precision = 'bf16' (no loss scaling) or comm.mode = 'allreduce'")
