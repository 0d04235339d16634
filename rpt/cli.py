"""The `rpt` command: one entry point, one sub-command per job.

A user error (`RptError`) is printed as one message with its fix and exit status 2; `--debug`
shows the traceback instead. Anything else is a bug in rpt and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rpt.errors import RptError


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with the run's settings (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting; repeat as needed, e.g. --set train.max_steps=100")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rpt", description="Pretrain deep recurrent language models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="train a byte-level BPE tokenizer and write token shards",
                       description="Turn text into train.bin / val.bin token shards, tokenizer.json and meta.json. "
                                   "With no --input, prepares the embedded default corpus: the Python standard library.")
    p.add_argument("--input", nargs="+", metavar="PATH", help="files, folders (recursive) or glob patterns; "
                   ".jsonl holds one document per line, .gz is read through gzip")
    p.add_argument("--out", required=True, type=Path, help="output folder, e.g. data/NAME")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents (or of the text) for validation")
    p.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")
    p.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token storage type")
    p.add_argument("--tokenizer-train-bytes", type=int, default=1 << 30,
                   help="train the tokenizer on a sample of about this many bytes of a larger corpus")
    p.add_argument("--force", action="store_true", help="replace a different dataset in --out")
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("config", help="print the resolved configuration (defaults + --config + --set), validated")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_config)
    return parser


def _cmd_prepare(args) -> None:
    from rpt.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(out=args.out, inputs=args.input, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                          tokenizer=args.tokenizer, text_field=args.text_field, dtype=args.dtype,
                          tokenizer_train_bytes=args.tokenizer_train_bytes, force=args.force)
    meta = prepare(opts)
    print(format_prepare_report(meta, args.out))


def format_prepare_report(meta: dict, out: Path) -> str:
    if meta.get("reused"):
        head = f"{out} already holds this dataset (same inputs and settings); nothing to do. --force rebuilds it."
    else:
        head = f"prepared {out} in {meta['seconds']['total']:.1f} s"
    report, sources = meta["report"], meta["sources"]
    lines = [head,
             f"  sources     {sources['files']} files, {sources['bytes'] / 1e6:.1f} MB ({', '.join(sources['inputs'])})",
             f"  documents   {report['documents']}",
             f"  tokenizer   byte-level BPE, vocabulary {meta['vocab_size']}, stored as {meta['dtype']}"]
    for name, s in meta["splits"].items():
        lines.append(f"  {name:<11} {s['tokens']:,} tokens, {s['bytes']:,} bytes "
                     f"({s['bytes'] / max(s['tokens'], 1):.2f} bytes/token), {s['documents']} documents")
    lines.append(f"  split       {meta['split_rule']['kind']}: {meta['split_rule']['rule']}")
    if report["replaced_sequences"]:
        lines.append(f"  note        {report['replaced_sequences']} undecodable byte sequences were replaced by U+FFFD")
    if report["skipped_binary"]:
        lines.append(f"  note        {len(report['skipped_binary'])} binary files skipped, e.g. {report['skipped_binary'][0]}")
    if report["bad_jsonl_lines"]:
        lines.append(f"  note        {report['bad_jsonl_lines']} jsonl lines without a text field were skipped")
    return "\n".join(lines)


def _cmd_config(args) -> None:
    from rpt.config import Config

    print(Config.load(args.config, args.overrides).to_toml(), end="")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    main()
