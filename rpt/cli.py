"""The `rpt` command: one entry point, one sub-command per job.

A user error (`RptError`) is printed as one message with its fix and exit status 2; `--debug`
shows the traceback instead. Anything else is a bug in rpt and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rpt.errors import RptError
from rpt.net import port_option


CHECKPOINT_HELP = ("which checkpoint: best (the default: lowest validation loss, ranked among the checkpoints "
                   "measured on the same validation tokens, the periodic evaluations' train.eval_tokens), latest "
                   "(the newest complete one), a step (6000 or step_00006000), or a checkpoint folder")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with the run's settings (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting; repeat as needed, e.g. --set train.max_steps=100")


def _vocab_size(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor auto (e.g. 8192, or auto)") from None


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="train a byte-level BPE tokenizer and write token shards",
                       description="Turn text into train.bin / val.bin token shards, tokenizer.json and meta.json. "
                                   "With no --input, prepares the embedded default corpus: the Python standard library.")
    p.add_argument("--input", nargs="+", metavar="PATH", help="files, folders (recursive) or glob patterns; "
                   ".jsonl holds one document per line, .parquet one per row, .gz and .zst are read compressed, a folder "
                   "saved by datasets' save_to_disk as its rows")
    p.add_argument("--out", required=True, type=Path, help="output folder, e.g. data/NAME")
    p.add_argument("--vocab-size", type=_vocab_size, default="auto",
                   help="BPE vocabulary size, or auto (the default): twice the words the corpus repeats, in steps "
                        "of 4096 from 8192 to 32768")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents (or of the text) for validation")
    p.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")
    p.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token storage type")
    p.add_argument("--tokenizer-train-bytes", type=int, default=1 << 30,
                   help="train the tokenizer on a sample of about this many bytes of a larger corpus")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="write a split of more tokens as SPLIT/00000.bin, ... of at most this many tokens each")
    p.add_argument("--dedup", action="store_true", help="drop documents whose text equals an earlier one's")
    p.add_argument("--max-doc-chars", type=int, default=0, help="cut documents longer than this (0: no cap)")
    p.add_argument("--workers", type=int, default=1, help="processes that encode on this machine")
    p.add_argument("--part", metavar="I/N", type=_part,
                   help="encode only part I of N (from 0) of the inputs, e.g. one per machine or SLURM array task; "
                        "the last part to finish writes the dataset")
    p.add_argument("--merge", action="store_true",
                   help="only write the dataset from the parts prepared for --out (every part must be complete)")
    p.add_argument("--force", action="store_true", help="replace a different dataset in --out (or an unfinished "
                   "prepare of other inputs)")
    p.set_defaults(func=_cmd_prepare)


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not I/N, e.g. 0/4") from None
    return i, n


def _add_model_io(sub) -> None:
    """rpt export and rpt lm-eval: models out to transformers and lm-evaluation-harness (docs/models.md)."""
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face transformers folder (safetensors)",
                       description="model.safetensors, config.json, the tokenizer and modeling_rpt.py: "
                                   "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) loads it")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, type=Path, help="the folder to write, e.g. exports/NAME")
    p.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    p.add_argument("--max-shard-size", default="5GB", help="weights above this size are written in several files")
    p.add_argument("--force", action="store_true", help="replace what is in --out")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks on an export (or a run, exported first)")
    p.add_argument("path", metavar="DIR", help="a folder `rpt export` wrote, or a run directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="a folder of your own task YAML files")
    p.add_argument("--limit", type=float, help="at most this many documents per task (or a share, below 1)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, help="tokens a request is read in at once (lm-eval's default: 2048); "
                                                    "a longer text is cut into windows that start afresh")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--checkpoint", default="best", help="of a run directory: " + CHECKPOINT_HELP)
    p.add_argument("--depth", type=int, help="a looped model's iterations (default: its training mean)")
    p.add_argument("--output", type=Path, help="write lm-eval's results as JSON here")
    p.set_defaults(func=_cmd_lm_eval)


def _add_eval_generate(sub) -> None:
    """rpt eval and rpt generate: a run's checkpoint scored and sampled."""
    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a run's checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    p.add_argument("--data", help="another prepared dataset (same tokenizer) to evaluate on")
    p.add_argument("--depth", type=int, help="a looped model's iterations (default: its model.loop_mean)")
    p.add_argument("--by-position", action="store_true", help="also bits per byte by the position of each token "
                   "in its document (1-64, 65-256, ...): whether the model uses long context")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("generate", help="stream text from a run's checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: the most likely token each time")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.95, help="... that hold this share of the probability (1: all)")
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint", default="best", help=CHECKPOINT_HELP)
    p.add_argument("--depth", type=int, help="a looped model's iterations per token (default: its model.loop_mean; "
                   "with --exit, the most: 4 x loop_mean)")
    p.add_argument("--exit", metavar="CRITERION:THRESHOLD", help="a looped model ends a token's iterations early: "
                   "kl:5e-4 (successive next-token distributions), shortlist:5e-4 (the same over the clustered "
                   "head's shortlist), change:0.01 (the state's relative change)")
    p.add_argument("--shared-state", action="store_true", help="a looped model keeps one state for all its "
                   "iterations (each continues from the previous token's last): less memory, some loss")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=_cmd_generate)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a run's model over HTTP (the OpenAI completions API), many streams at once",
                       description="An OpenAI-compatible server (POST /v1/completions, GET /v1/models, /health, "
                       "/metrics) that generates its streams as one batch, each at constant memory (docs/serving.md).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    from rpt.serve.config import ServeConfig

    ServeConfig.add_arguments(p, helps={"checkpoint": CHECKPOINT_HELP})
    p.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rpt", description="Pretrain deep recurrent language models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_prepare(sub)

    p = sub.add_parser("train", help="train a model (one process, --nproc N local processes, or under torchrun)",
                       description="Train a recurrent language model. Everything the run writes goes into --run-dir.")
    _add_config_flags(p)
    p.add_argument("--run-dir", type=Path, help="where the run writes (default: runs/CONFIG-TIMESTAMP)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest complete checkpoint (its config.toml unless --config)")
    p.add_argument("--nproc", type=int, default=1, help="launch this many local worker processes (data parallel)")
    p.add_argument("--profile", metavar="START:END",
                   help="torch.profiler traces of these steps on every rank, into RUN_DIR/traces/ (monitor.profile)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart failed workers this often, from the newest checkpoint")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=_cmd_train)

    _add_eval_generate(sub)
    _add_serve(sub)
    _add_model_io(sub)

    _add_scaling(sub)

    p = sub.add_parser("topology", help="measure latency and bandwidth between ranks; predict each comm mode's cost",
                       description="Run under torchrun on every node (or --nproc N on this machine).")
    _add_config_flags(p)
    p.add_argument("--nproc", type=int, default=1, help="launch this many local ranks")
    p.add_argument("--message-mb", type=float, default=4.0, help="size of the bandwidth probe")
    p.add_argument("--out", help="also write the measurements and predictions to this JSON file")
    p.set_defaults(func=_cmd_topology)

    p = sub.add_parser("plan", help="the parallel plan for N ranks: stages, blocks, memory and traffic per rank",
                       description="Runs nothing and allocates nothing (the model is built on the meta device).")
    _add_config_flags(p)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs or processes)")
    p.add_argument("--device-memory-gb", type=float, default=80.0,
                   help="memory per rank in GiB, for parallel.pp = auto and the fit check (default 80)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("monitor", help="live web dashboard of one or more runs",
                       description="Serves a read-only dashboard of the runs' metrics (loopback by default).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=port_option(), default=8765, help="1-65535")
    p.add_argument("--token", help="require ?token=TOKEN on every request")
    p.set_defaults(func=_cmd_monitor)

    p = sub.add_parser("config", help="print the resolved configuration (defaults + --config + --set), validated")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_config)
    for p in sub.choices.values():  # --debug also after the sub-command; absent there, the top-level value holds
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for user errors")
    return parser


def _add_scaling(sub) -> None:
    p = sub.add_parser("scaling", help="measure the compute-optimal frontier of your data: a grid of runs, a fitted law",
                       description="A grid of short `rpt train` runs at training-FLOP budgets (resumable; split it "
                                   "over processes with --worker), and the scaling law fitted to them (docs/scaling.md).")
    steps = p.add_subparsers(dest="step", required=True, metavar="STEP")
    for name, text in (("run", "train the grid's points not yet done, then fit"),
                       ("commands", "print each pending point's `rpt train` command (for torchrun, a SLURM array)")):
        q = steps.add_parser(name, help=text, description=text)
        q.add_argument("folder", type=Path, help="the grid's folder (its grid.json, points/, logs/, law.json)")
        q.add_argument("--data", action="append", default=[], help="a prepared corpus (repeat: one per vocabulary)")
        q.add_argument("--budgets", help="training FLOPs, comma-separated, e.g. 1e13,3e13,1e14")
        q.add_argument("--families", default="lstm", help="recurrent families, comma-separated (default lstm)")
        q.add_argument("--sizes", help="LAYERSxWIDTH, comma-separated (default: the recipe's ladder to 2x512)")
        q.add_argument("--batches", default="0", help="rows a step, comma-separated (0, the default: the recipe's)")
        q.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="a setting every point trains with (repeatable)")
        q.add_argument("--worker", default="0/1", metavar="I/N", help="run every N-th point from the I-th")
        q.set_defaults(func=_cmd_scaling)
    q = steps.add_parser("fit", help="fit the law to the finished points; write law.json, the table and a figure")
    q.add_argument("folder", type=Path)
    q.add_argument("--upto", type=float, default=0.0, help="fit only the budgets up to this many FLOPs")
    q.add_argument("--law", type=Path, help="where to write the law (default FOLDER/law.json)")
    q.add_argument("--plot", type=Path, help="draw the frontier into this PNG (default FOLDER/frontier.png where "
                   "matplotlib, the bench extra, is installed)")
    q.add_argument("--predict", default="", help="more budgets (FLOPs, comma-separated) for the table")
    q.set_defaults(func=_cmd_scaling)
    p.set_defaults(func=_cmd_scaling)


def _cmd_scaling(args) -> None:
    from rpt.scaling import grid as grids

    if args.step == "fit":
        return _scaling_fit(args)
    given = None
    if args.data or args.budgets:
        if not (args.data and args.budgets):
            raise RptError("a new grid needs both --data and --budgets", "e.g. --data data/mine --budgets 1e13,3e13,1e14")
        given = grids.Grid(data=[str(Path(d)) for d in args.data], budgets=grids.parse_budgets(args.budgets),
                           families=[f.strip() for f in args.families.split(",") if f.strip()],
                           sizes=grids.parse_sizes(args.sizes) if args.sizes else list(grids.DEFAULT_SIZES),
                           batches=[int(b) for b in args.batches.split(",")], sets=list(args.sets))
        given.check()
    grid = grids.open_grid(args.folder, given, sys.stderr)  # (stdout: only the commands, for a script)
    try:
        index, count = (int(v) for v in args.worker.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise RptError(f"--worker {args.worker}: I/N with 0 <= I < N", "e.g. --worker 0/4 ... --worker 3/4") from None
    from rpt.scaling.runner import run_points, worker_share

    if args.step == "commands":
        for point in worker_share(grid.points(), (index, count)):
            if grids.finished(args.folder, point) is None:
                print(grids.shell_line(args.folder, point))
        return
    failed = run_points(args.folder, grid, (index, count))
    if failed:
        raise RptError(f"{len(failed)} point(s) failed: {', '.join(failed)}",
                       f"read their logs in {args.folder / 'logs'}; run the same command again to retry them")
    if all(grids.finished(args.folder, p) for p in grid.points()):
        args.upto, args.law, args.plot, args.predict = 0.0, None, None, ""
        try:
            _scaling_fit(args)
        except RptError as exc:  # the runs are done; only the law must wait for more of them
            print(f"every point has run; no law yet: {exc}", file=sys.stderr)


def _scaling_fit(args) -> None:
    from rpt.scaling.grid import open_grid, parse_budgets
    from rpt.scaling.law import fit_law
    from rpt.scaling.report import plot, table
    from rpt.scaling.runner import results

    grid = open_grid(args.folder, None)
    law = fit_law(results(args.folder, grid), grid.to_json(), args.upto)
    out = args.law or args.folder / "law.json"
    law.save(out)
    text = table(law, parse_budgets(args.predict) if args.predict else None)
    (out.with_suffix(".md")).write_text(text + "\n")
    print(text)
    figure = args.plot or out.with_name("frontier.png")
    try:
        plot(law, figure, parse_budgets(args.predict) if args.predict else None)
        print(f"figure: {figure}")
    except ImportError:
        if args.plot:
            raise RptError("--plot needs matplotlib", "pip install 'rpt[bench]' (or matplotlib)") from None
        print("(no figure: matplotlib is not installed; pip install 'rpt[bench]' draws one)")
    print(f"law: {out} (--set recipe.law={out} sizes a run from it)")


def _cmd_prepare(args) -> None:
    from rpt.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(out=args.out, inputs=args.input, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                          tokenizer=args.tokenizer, text_field=args.text_field, dtype=args.dtype,
                          tokenizer_train_bytes=args.tokenizer_train_bytes, force=args.force,
                          shard_tokens=args.shard_tokens, dedup=args.dedup, max_doc_chars=args.max_doc_chars,
                          workers=args.workers, part=args.part, merge=args.merge)
    meta = prepare(opts)
    print(format_prepare_report(meta, args.out))


def format_prepare_report(meta: dict, out: Path) -> str:
    if "units_done" in meta:  # a part of a job that is not complete yet
        if meta.get("merging_elsewhere"):
            h = meta["merging_elsewhere"]
            return f"every unit of {out} is prepared; another process ({h['host']}, pid {h['pid']}) writes the dataset"
        i, n = meta["part"]
        return (f"part {i}/{n} of {out} is prepared ({meta['units_mine']} units); {meta['units_done']} of "
                f"{meta['units']} units of the job are done, in {meta['work']}. The last part to finish writes the "
                f"dataset (or, once all are done: rpt prepare --out {out} --merge)")
    if meta.get("reused"):
        head = f"{out} already holds this dataset (same inputs and settings); nothing to do. --force rebuilds it."
    else:
        head = f"prepared {out} in {meta['seconds']['total']:.1f} s"
    report, sources = meta["report"], meta["sources"]
    lines = [head,
             f"  sources     {sources['files']} files, {report['text_bytes'] / 1e6:.1f} MB of text "
             f"({sources['bytes'] / 1e6:.1f} MB on disk; {', '.join(sources['inputs'])})",
             f"  documents   {report['documents']}",
             f"  tokenizer   byte-level BPE, vocabulary {meta['vocab_size']}, stored as {meta['dtype']}"
             + (f" ({meta['vocab_choice']})" if meta.get("vocab_choice") else "")]
    for name, s in meta["splits"].items():
        lines.append(f"  {name:<11} {s['tokens']:,} tokens, {s['bytes']:,} bytes "
                     f"({s['bytes'] / max(s['tokens'], 1):.2f} bytes/token), {s['documents']} documents")
    lines.append(f"  split       {meta['split_rule']['kind']}: {meta['split_rule']['rule']}")
    if report.get("duplicate_documents"):
        lines.append(f"  dedup       {report['duplicate_documents']:,} duplicate documents dropped "
                     f"({report['duplicate_tokens']:,} tokens)")
    if report.get("truncated_documents"):
        lines.append(f"  length cap  {report['truncated_documents']:,} documents cut, "
                     f"{report['truncated_chars']:,} characters left out")
    if report["replaced_sequences"]:
        lines.append(f"  note        {report['replaced_sequences']} undecodable byte sequences were replaced by U+FFFD")
    if report["skipped_binary"]:
        lines.append(f"  note        {len(report['skipped_binary'])} binary files skipped, e.g. {report['skipped_binary'][0]}")
    if report["bad_jsonl_lines"]:
        lines.append(f"  note        {report['bad_jsonl_lines']} jsonl lines that are not JSON objects were skipped")
    if report.get("missing_field_lines"):
        lines.append(f"  note        {report['missing_field_lines']} jsonl records without the text field were skipped "
                     f"(fields of the first: {', '.join(report['fields_seen'])})")
    return "\n".join(lines)


def _cmd_train(args) -> None:
    from rpt.train.run_dir import default_run_dir
    from rpt.train.trainer import train

    if args.resume and args.run_dir is None:
        raise RptError("--resume needs the run to continue", "name it with --run-dir RUN_DIR")
    if args.nproc < 1:
        raise RptError(f"--nproc {args.nproc} must be 1 or more", "e.g. --nproc 2")
    if args.resume and not (args.run_dir / "config.toml").is_file():
        raise RptError(f"--resume: {args.run_dir} holds no run (no config.toml there)",
                       _runs_nearby(args.run_dir) + "; without --resume, a new run starts in that folder")
    config_path = args.config
    if args.resume and any(o.split("=", 1)[0].strip() == "train.init_from" for o in args.overrides):
        raise RptError("--set train.init_from with --resume: a resumed run continues from its own checkpoint",
                       "drop --set train.init_from to resume; to start from other weights, start a new run "
                       "(another --run-dir) with it")
    run_file = args.resume and config_path is None  # the run's own config.toml, with the origins it records
    if run_file:
        config_path = str(args.run_dir / "config.toml")
    overrides = args.overrides + ([f"monitor.profile={args.profile}"] if args.profile else [])
    cfg = load_config(config_path, overrides, run_file=run_file)
    run_dir = args.run_dir or default_run_dir(args.config)
    _check_writable(run_dir)
    if args.max_restarts and not (cfg.checkpoint.interval or cfg.checkpoint.interval_minutes):
        print(f"warning: --max-restarts {args.max_restarts} with no periodic checkpoint (checkpoint.interval and "
              "interval_minutes are 0): a restarted run starts again from step 0; set checkpoint.interval_minutes "
              "(e.g. 15) or checkpoint.interval", file=sys.stderr)
    if args.nproc > 1:
        from rpt.train.resolve import check_layout

        check_layout(cfg, args.nproc)  # before any worker starts
    # Under torchrun every rank runs this command: rank 0 alone judges the folder, before any rank writes
    # to it, and a restarted group continues its own run.
    first_look = int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if first_look and not args.resume and (run_dir / "config.toml").exists():
        raise RptError(f"{run_dir} already holds a run", "continue it with --resume, or choose another --run-dir")
    from rpt.testing import faults  # RPT_FAULT: a rank that fails on purpose (rpt/testing/faults.py)

    from rpt.runtime.command_clock import command_clock

    with command_clock(args.started):  # what the run's summary counts its seconds from
        summary = train(cfg, run_dir, args.resume, args.nproc, args.max_restarts, args.device,
                        faults.hooks_from_env if faults.from_env() else None)
    if summary is not None and summary.get("interrupted"):  # stopped after a step, with a checkpoint (said)
        sys.exit(130)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 reports for the job
        return
    if summary is not None:
        print(f"val loss {summary['val_loss']:.4f}  ppl {summary['val_ppl']:.2f}  bpb {summary['val_bpb']:.4f}  "
              f"(on {summary['val_tokens']:,} validation tokens; {summary['steps']} steps, {summary['tokens']:,} "
              f"tokens, {summary['tokens_per_second']:,.0f} tokens/s)")
    print(run_dir / "summary.json")


def _runs_nearby(run_dir: Path) -> str:
    """The fix for a mistyped run folder: the runs beside it, closest name first."""
    import difflib

    parent = run_dir.parent if run_dir.parent.is_dir() else Path("runs")
    runs = sorted(p.name for p in parent.glob("*") if (p / "config.toml").is_file()) if parent.is_dir() else []
    if not runs:
        return f"name the folder of an earlier run (none found in {parent})"
    close = difflib.get_close_matches(run_dir.name, runs, n=1, cutoff=0.5)
    listed = ", ".join(str(parent / r) for r in runs[-5:])
    return (f"did you mean {parent / close[0]}? " if close else "") + f"runs in {parent}: {listed}"


NO_PRESET = {"train.recipe": ("auto", "no --config: the default recipe chooses what --set does not give")}


def load_config(path: str | None, overrides: list[str], run_file: bool = False):
    """The configuration every command uses: Config.load (without a file: the default recipe on), the model's cell
    and gate names against the registry (with model.imports found in the working directory or beside the config
    file), then the checks that span sections and the model built on the meta device (rpt/train/resolve.py), so
    that `rpt config` refuses what `rpt train` would. `run_file`: `path` is the run's own config.toml (a resume)."""
    from rpt.config import Config
    from rpt.models.registry import check_names
    from rpt.train.resolve import check

    cfg = Config.load(path, overrides, run_file=run_file, implied=NO_PRESET if path is None else None)
    check_names(cfg.model, [Path(path).parent] if path else [])  # (imports model.imports: the checks build the model)
    check(cfg)
    return cfg


def _check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise RptError(f"the run directory {run_dir} is a file", "choose another --run-dir (a folder)")
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    import os

    if not os.access(probe, os.W_OK):
        raise RptError(f"cannot write the run directory {run_dir} ({probe} is not writable)",
                       "choose a --run-dir you can write to")


def _cmd_eval(args) -> None:
    from rpt.train.evaluate import eval_run

    r = eval_run(args.run_dir, args.checkpoint, args.device, args.data, args.depth, args.by_position)
    at = f" at depth {r['depth']}" if r["depth"] is not None else ""
    print(f"{r['checkpoint']} ({r['about']})\n"
          f"whole validation split{at}: val loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  bpb {r['bpb']:.4f}  "
          f"({r['tokens']:,} tokens, {r['bytes']:,} bytes)")
    bins = r.get("by_position", [])
    if bins and not any(b["tokens"] for b in bins):
        print("  by position: no token's position is known: the validation split holds no document start (no "
              "end-of-text token), so nothing says where its documents begin. Prepare the data from several files "
              "or jsonl records (rpt prepare), so that whole documents are held out, to measure it")
        return
    for b in bins:
        where = f"{b['from']:,}-{b['to']:,}" if b["to"] else f"{b['from']:,}-"
        bpb = f"{b['bpb']:.4f}" if b["bpb"] is not None else "-"
        print(f"  position {where:>12}  bpb {bpb}  ({b['tokens']:,} tokens)")


def _cmd_generate(args) -> None:
    from rpt.train.generation import generate_text

    generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                  args.seed, args.checkpoint, args.device, depth=args.depth, exit=args.exit,
                  shared=args.shared_state)


def _cmd_serve(args) -> None:
    from rpt.serve.config import ServeConfig
    from rpt.serve.server import serve

    serve(args.run_dir, ServeConfig.from_args(args))


def _cmd_export(args) -> None:
    from rpt.export.hf_export import export_run

    r = export_run(args.run_dir, args.out, args.checkpoint, args.max_shard_size, args.force)
    print(f"exported {r['checkpoint']} ({r['about']}, {r['params']:,} parameters) to {r['out']}:\n  "
          + "  ".join(r["files"]) + f"\nLoad it with AutoModelForCausalLM.from_pretrained('{r['out']}', "
          "trust_remote_code=True); evaluate with rpt lm-eval " + r["out"] + " --tasks TASK")


def _cmd_lm_eval(args) -> None:
    import json

    from rpt.export.lm_eval_run import run_lm_eval, summary

    results = run_lm_eval(args.path, [t for t in args.tasks.split(",") if t], args.include_path, args.limit,
                          args.batch_size, args.device, args.num_fewshot, checkpoint=args.checkpoint,
                          max_length=args.max_length, depth=args.depth)
    print(summary(results))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot") if k in results},
                                          indent=2, default=str))


def _cmd_topology(args) -> None:
    from rpt.parallel.topology_command import run_topology

    run_topology(load_config(args.config, args.overrides), args.nproc, args.message_mb, args.out)


def _cmd_plan(args) -> None:
    import json

    from rpt.parallel.plan import GiB, choose_plan, format_plan
    from rpt.parallel.topology_command import with_data_vocabulary

    if args.world_size < 1:
        raise RptError(f"--world-size {args.world_size} must be at least 1", "e.g. --world-size 8")
    cfg = with_data_vocabulary(load_config(args.config, args.overrides))
    plan = choose_plan(cfg, args.world_size, int(args.device_memory_gb * GiB))
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))


def _cmd_monitor(args) -> None:
    from rpt.monitor.server import serve

    serve(args.run_dirs, args.host, args.port, args.token)


def _cmd_config(args) -> None:
    cfg = load_config(args.config, args.overrides)
    for note in cfg.notes:  # what loading changed or warns of, as `rpt train` says it at start
        print(f"# {note}", file=sys.stderr)
    if args.config is not None:  # each value with where it came from (the file, --set, the default)
        print(cfg.to_toml(origins=True), end="")
        return
    from rpt.train.recipe import CHOOSES

    open_keys = sorted(CHOOSES - cfg.given)
    print("# No --config: `rpt train` runs the default recipe, which chooses at start, from the data and the budget,\n"
          "# the values marked below (--set any of them to choose it yourself); the others hold as shown.")
    section = ""
    for line in cfg.to_toml().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        key = f"{section}.{line.split('=', 1)[0].strip()}" if "=" in line else ""
        print(line + ("  # the default recipe chooses" if key in open_keys else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, an unknown option refused by its sub-command's parser (its usage, and the option it
    nearly spells), not by the top-level one."""
    import difflib

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(unknown[0].split("=", 1)[0], options, n=1, cutoff=0.6)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else ""))
    return args


def main(argv: list[str] | None = None) -> None:
    """`rpt ARGS`. From a shell (argv None) the process ends as soon as the command has: its exit handlers run and
    its output is flushed, but not the interpreter's teardown of torch's modules (0.6 s of every command, and
    where torch had imported Triton through torch._dynamo, nanobind's leak report of Triton's objects under a
    clean error). Called from Python (argv given), it returns, or raises SystemExit, as any function."""
    import time

    from rpt.runtime.command_clock import process_started

    if argv is not None:
        return run(argv, time.time())
    started = process_started() or time.time()  # from a shell the command began with its process
    try:
        run(None, started)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # a bug of rpt's: its traceback, as Python would print it
        import traceback

        traceback.print_exc()
        code = 1
    exit_now(code)


def exit_now(code: int) -> None:
    """End the process: the other threads that hold it open joined, the exit handlers run (logging's, the
    libraries'), the output flushed, then out, past the interpreter's module teardown."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run(argv: list[str] | None, started: float) -> None:
    args = parse_args(argv)
    args.started = started
    try:
        args.func(args)
    except RptError as exc:
        if args.debug:
            raise
        print(f"rpt {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # `rpt ... | head` closed the pipe: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        sys.exit(141)


if __name__ == "__main__":
    main()
