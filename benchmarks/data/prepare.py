"""Benchmark: `rpt prepare` on the embedded default corpus (the Python standard library).

Target (issue 2): the whole corpus, tokenizer training included, in <= 15 s on the 2-core build machine.
Prints one markdown row for benchmarks/results/data.md.

    .venv/bin/python benchmarks/data/prepare.py [--repeats 3] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
from datetime import date
from pathlib import Path

from rpt.data.prepare import PrepareOptions, prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            meta = prepare(PrepareOptions(out=Path(tmp) / "stdlib", vocab_size=args.vocab_size, force=True, progress=False))
            runs.append(meta["seconds"])
            print(f"run {i}: {meta['seconds']}")
    total = statistics.median(r["total"] for r in runs)
    mb = meta["sources"]["bytes"] / 1e6
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"| {date.today()} | {platform.machine()} {os.cpu_count()} cores | {commit} | "
          f"`python benchmarks/data/prepare.py --vocab-size {args.vocab_size}` | "
          f"{mb:.1f} MB, {tokens:,} tokens: median {total:.2f} s (tokenizer "
          f"{statistics.median(r['tokenizer'] for r in runs):.2f} s, encode {statistics.median(r['encode'] for r in runs):.2f} s), "
          f"{mb / total:.1f} MB/s end to end; target <= 15 s |")


if __name__ == "__main__":
    main()
