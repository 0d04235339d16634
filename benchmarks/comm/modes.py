"""Communication modes and codecs on an emulated cluster with real bandwidth limits (issue 5).

For each case: build the cluster (netns.py), run `rpt topology` across it (the cost model's
prediction per mode), then `rpt train` under torchrun on every node for a fixed number of
steps, and read the run's summary. Prints one markdown row per case: measured communication
time per step against the prediction, exposed and hidden time, bytes per rank, tokens/s, loss.

    sudo .venv/bin/python benchmarks/comm/modes.py                 # the default cases
    .venv/bin/python benchmarks/comm/modes.py --cases 2x100:allreduce:none 2x100:ps:none

A case is NODESxMBIT[/MBIT0]:MODE:CODEC; MBIT0, when given, is node 0's link (a faster server).
One rank per node; on a 2-core machine 4 nodes share the cores, so compute slows while the
network figures stay honest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import Cluster, available  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CASES = [
    "2x100:allreduce:none", "2x100:ps:none", "2x100:ps-sharded:none", "2x100:allreduce:fp16",
    "2x100:allreduce:powersgd", "2x100:allreduce:topk", "2x100:auto:none",
    "4x100:allreduce:none", "4x100:ps:none", "4x100:ps-sharded:none",
    "4x100/1000:ps:none", "4x100/1000:allreduce:none", "4x100/1000:auto:none",
]


def parse_case(case: str) -> tuple[int, list[float], str, str]:
    shape, mode, codec = case.split(":")
    nodes, rates = shape.split("x")
    rate, _, rate0 = rates.partition("/")
    links = [float(rate)] * int(nodes)
    if rate0:
        links[0] = float(rate0)
    return int(nodes), links, mode, codec


def run_case(case: str, data: str, steps: int, extra: list[str], workdir: Path) -> dict:
    nodes, links, mode, codec = parse_case(case)
    model = ["--set", f"data.path={data}", "--set", "model.d_model=256", "--set", "model.n_layers=2",
             "--set", "train.batch_size=16", "--set", "train.seq_len=64", "--set", "comm.bucket_mb=1", *extra]
    run_dir = workdir / case.replace(":", "_").replace("/", "-")
    with Cluster(nodes, rates_mbit=links) as c:
        topo_out = workdir / f"{run_dir.name}-topology.json"
        topo = [c.popen(i, c.torchrun(i, 1, ["-m", "rpt", "topology", "--message-mb", "2", "--out", str(topo_out),
                                             *model]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in c.nodes]
        logs = [p.communicate(timeout=300)[0] for p in topo]
        if any(p.returncode for p in topo):
            raise RuntimeError(f"{case}: rpt topology failed:\n" + logs[0][-3000:])
        args = ["-m", "rpt", "train", "--run-dir", str(run_dir), *model, "--set", f"train.max_steps={steps}",
                "--set", "train.eval_interval=0", "--set", "train.eval_tokens=4096", "--set", f"comm.mode={mode}",
                "--set", f"comm.compression={codec}", "--set", "monitor.log_interval=5", "--set", "train.warmup_steps=5"]
        train = [c.popen(i, c.torchrun(i, 1, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in c.nodes]
        logs = [p.communicate(timeout=900)[0] for p in train]
        if any(p.returncode for p in train):
            raise RuntimeError(f"{case}: rpt train failed:\n" + logs[0][-3000:])
    s = json.loads((run_dir / "summary.json").read_text())
    t = json.loads(topo_out.read_text())
    used = s["comm_mode"]
    return {"case": case, "mode": used, "codec": codec, "predicted_ms": 1e3 * t["predicted_seconds"][used],
            "timed_ms": 1e3 * t["timed_seconds"][used],
            "chosen_by_model": t["chosen"], "comm_ms": 1e3 * s["comm_seconds_per_step"],
            "exposed_ms": 1e3 * s["exposed_comm_seconds_per_step"],
            "hidden": 1 - s["exposed_comm_fraction"] if s["exposed_comm_fraction"] is not None else None,
            "mb_per_rank": [b / 2**20 for b in s["comm_bytes_per_step_by_rank"]],
            "tokens_per_s": s["tokens_per_second"], "train_loss": s["train_loss"], "grad_mb": t["gradient_bytes"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare-512"))
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more rpt train --set overrides")
    ap.add_argument("--keep", help="keep the run directories under this folder (default: a temporary one)")
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"cannot build the emulated cluster here: {why}")
    if not (Path(args.data) / "meta.json").is_file():
        sys.exit(f"{args.data} is not prepared: run `bash benchmarks/training/shakespeare.sh` once, or pass --data")
    extra = [x for kv in args.extra for x in ("--set", kv)]
    print("| case | mode in force | codec | model ms | pattern timed ms | comm ms | exposed ms | hidden | MiB sent per rank | tokens/s | train loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="rpt-cluster-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for case in args.cases:
            r = run_case(case, args.data, args.steps, extra, workdir)
            hidden = f"{r['hidden']:.2f}" if r["hidden"] is not None else "-"
            sent = "/".join(f"{m:.2f}" for m in r["mb_per_rank"])
            print(f"| {r['case']} | {r['mode']} | {r['codec']} | {r['predicted_ms']:.0f} | {r['timed_ms']:.0f} | {r['comm_ms']:.0f} | "
                  f"{r['exposed_ms']:.0f} | {hidden} | {sent} | {r['tokens_per_s']:,.0f} | {r['train_loss']:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
