"""Benchmark: `rpt prepare` on a generated parquet corpus against HF tokenizers' own `encode_batch`.

Issue 25's targets: preparing about 200 MB of parquet runs at >= 0.85x the throughput of `encode_batch_fast`
on the same text and cores (reading, splitting and writing cost at most 15%), with peak RSS of any process
under 1 GB; rpt runs with `--workers 2` (change with --workers).
The corpus: tiny-shakespeare's speeches shuffled into documents of 1-8 KB (seeded), in row groups of 2,000
rows; the tokenizer is trained once beforehand and given to both, so only encoding is compared. Each side
runs in its own process (its peak RSS is its own); the two alternate, `--rounds` times.

    .venv/bin/python benchmarks/data/prepare_parquet.py --text ../shared/data/tinyshakespeare/input.txt [--mb 200] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENCODE = """
import json, resource, sys, time
import pyarrow.parquet as pq
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
t = time.perf_counter(); n = chars = 0
for batch in pq.ParquetFile(sys.argv[1], pre_buffer=False).iter_batches(batch_size=1024, columns=["text"], use_threads=False):
    texts = batch.column(0).to_pylist()
    n += sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
    chars += sum(map(len, texts))
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": n, "chars": chars,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

PREPARE = """
import json, resource, sys, time
from rpt.data.prepare import PrepareOptions, prepare
t = time.perf_counter()
meta = prepare(PrepareOptions(out=sys.argv[3], inputs=[sys.argv[1]], tokenizer=sys.argv[2], force=True, progress=False,
                              workers=int(sys.argv[4])))
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": sum(s["tokens"] for s in meta["splits"].values()),
                  "phases": meta["seconds"], "units": meta["units"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak_rss_workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def make_corpus(text: str, mb: float, path: Path) -> int:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    speeches, rng = text.split("\n\n"), random.Random(0)
    writer, size, rows = None, 0, []
    while size < mb * 1e6:
        doc = []
        while sum(map(len, doc)) < rng.randint(1000, 8000):
            doc.append(rng.choice(speeches))
        rows.append("\n\n".join(doc))
        size += len(rows[-1].encode())
        if len(rows) == 2000:
            table = pa.table({"text": rows, "id": list(range(len(rows)))})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
            rows = []
    if rows:
        table = pa.table({"text": rows, "id": list(range(len(rows)))})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return size


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True)
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="rpt prepare --workers")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        began = time.perf_counter()
        size = make_corpus(Path(args.text).read_text(), args.mb, tmp / "corpus.parquet")
        print(f"corpus: {size / 1e6:.1f} MB of text in {time.perf_counter() - began:.1f} s", flush=True)
        from rpt.data.prepare import PrepareOptions, prepare

        prepare(PrepareOptions(out=tmp / "tok", inputs=[args.text], progress=False))  # the tokenizer, BPE 8192
        tokenizer = str(tmp / "tok" / "tokenizer.json")
        for r in range(args.rounds):
            encode = run(ENCODE, str(tmp / "corpus.parquet"), tokenizer)
            rpt = run(PREPARE, str(tmp / "corpus.parquet"), tokenizer, str(tmp / "out"), str(args.workers))
            print(json.dumps({"round": r, "encode_batch": encode, "rpt_prepare": rpt,
                              "throughput_ratio": encode["seconds"] / rpt["seconds"],
                              "rpt_mb_per_s": size / 1e6 / rpt["seconds"],
                              "rpt_peak_rss_gib": max(rpt["peak_rss"], rpt["peak_rss_workers"]) / 2**30}), flush=True)


if __name__ == "__main__":
    main()
