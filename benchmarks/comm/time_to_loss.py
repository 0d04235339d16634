"""Time to a target validation loss for each communication mode and codec, on the emulated cluster (issue 23).

Two nodes (netns.py), one rank and one core each, the link shaped to a rate. First fp32 DDP (all-reduce, no
codec: "traditional") trains `--steps` steps; the validation loss it reaches there is the target. Then every
configuration trains from the same start until a periodic validation (the same 4,096 held-out tokens each time)
reaches the target, or until `--cap` x steps; the run is stopped once it has, and has also been measured at the
baseline's step count. Reported per configuration:
wall time to the target (from the end of step 1: start-up left out), steps and tokens to it, bytes sent per
rank, the share of the step spent in exposed communication, and the validation loss at the baseline's step
count. The learning rate is constant after warm-up, so a run's schedule does not depend on when it stops. The model is
an lstm of 2 x 512 (8.4M parameters, vocabulary 8192) at batch 8 x 64 per rank: one core computes such a step
in about 0.27 s (DiLoCo's inner steps) while bf16 gradients take about 1.35 s at 100 Mbit/s, the network-bound
regime the modes are for.

    sudo .venv/bin/python benchmarks/comm/time_to_loss.py --data DATA                    # every case, both rates
    .venv/bin/python benchmarks/comm/time_to_loss.py --data DATA --rates 100 --cases bf16,diloco

`--target LOSS` takes the baseline's loss from an earlier run and skips it.
Rates: a number is Mbit/s; `auto35` finds the rate at which fp32 DDP spends about 35% of its step in exposed
communication (from the compute time per step of a short probe, then one correction) and says which.
The last line prints each configuration's time to target relative to bf16 DDP.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import Cluster, available  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model.cell=lstm", "model.n_layers=2", "model.d_model=512", "model.dropout=0", "train.batch_size=8",
         "train.seq_len=64", "train.lr=2e-3", "train.warmup_steps=20", "train.schedule=constant",
         "train.grad_clip=1.0", "train.eval_tokens=4096", "train.early_stop=0", "train.select_best=false",
         "monitor.log_interval=1", "comm.bucket_mb=4", "checkpoint.interval=0"]
DILOCO_STEPS = 30  # int8 every 30 steps: (4 bytes x 30) / (1 byte + its scales) = just under 120x fewer than fp32
CASES = {
    "fp32": ["comm.mode=allreduce", "comm.compression=none"],
    "bf16": ["comm.mode=allreduce", "comm.compression=bf16"],
    "ps": ["comm.mode=ps", "comm.compression=none"],
    "ps-sharded": ["comm.mode=ps-sharded", "comm.compression=none"],
    "powersgd": ["comm.mode=allreduce", "comm.compression=powersgd", "comm.powersgd_rank=4"],
    "topk": ["comm.mode=allreduce", "comm.compression=topk", "comm.topk_fraction=0.01"],
    "adaptive": ["comm.mode=allreduce", "comm.compression=none", "comm.adaptive=true"],
    # nothing pinned: the tied embedding (half the parameters here) may then be a minor group too; re-ranked
    # every 20 steps, so the all-groups phase before the first ranking is a sixth of the 120 steps, not 50 of them
    "adaptive-unpinned": ["comm.mode=allreduce", "comm.compression=none", "comm.adaptive=true", "comm.adaptive_pin=[]",
                          "comm.adaptive_interval=20"],
    # the outer step plain averaging (rate 1, no momentum): with 4 outer steps in 120, Nesterov 0.9 at 0.7 (the
    # paper's, for hundreds of outer steps) overshoots; the sweep is in benchmarks/results/comm.md
    "diloco": ["comm.mode=diloco", "comm.compression=int8", f"comm.diloco_steps={DILOCO_STEPS}",
               "comm.diloco_outer_lr=1.0", "comm.diloco_momentum=0"],
    "auto": ["comm.mode=auto", "comm.compression=none"],
}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def train(case: str, overrides: list[str], rate: float, data: str, steps: int, eval_every: int,
          target: float | None, workdir: Path, timeout: float, until: int = 0) -> dict:
    """One run of `case` at `rate` Mbit/s for `steps` steps, stopped early once validation has reached `target`
    and has been measured at step `until` (the baseline's count) too."""
    run_dir = workdir / f"{case}-{rate:g}"
    if target is None and (run_dir / "summary.json").exists():  # a finished baseline of an earlier invocation
        return summarise(case, rate, run_dir, target, None)
    sets = [f"data.path={data}", *MODEL, *overrides, f"train.max_steps={steps}", f"train.eval_interval={eval_every}"]
    args = ["-m", "rpt", "train", "--run-dir", str(run_dir), *[x for kv in sets for x in ("--set", kv)]]
    reached = None
    with Cluster(2, rates_mbit=rate) as c:
        procs = [c.popen(i, c.torchrun(i, 1, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in c.nodes]
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
            if target is not None:  # stop at the target, but not before the baseline's step count
                evals = [r for r in records(run_dir) if r["kind"] == "eval" and not r["final"]]
                hits = [r for r in evals if r["loss"] <= target]
                if hits and evals[-1]["step"] >= until:
                    reached = hits[0]
                    break
        c.close()  # at the target (or the deadline): every process left in the namespaces, torchrun's workers too
        outs = [p.communicate()[0] for p in procs]
    if reached is None and any(p.returncode for p in procs):
        raise RuntimeError(f"{case} at {rate:g} Mbit/s failed:\n{outs[0][-3000:]}")
    return summarise(case, rate, run_dir, target, reached)


def summarise(case: str, rate: float, run_dir: Path, target: float | None, reached: dict | None) -> dict:
    rows = records(run_dir)
    trains = {r["step"]: r for r in rows if r["kind"] == "train"}
    evals = [r for r in rows if r["kind"] == "eval" and not r["final"]]
    last = reached["step"] if reached else max(trains)  # what the figures below count up to
    evaluated = {r["step"] for r in evals}
    step_seconds = exposed = 0.0
    for s in range(2, last + 1):  # step times without the steps that ended in a validation
        if s in trains and s - 1 in trains and s - 1 not in evaluated:
            step_seconds += trains[s]["time"] - trains[s - 1]["time"]
            exposed += trains[s]["exposed_comm_seconds_per_step"]
    sent = sum(trains[s]["comm_bytes_per_step"] for s in range(1, last + 1) if s in trains)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    mode_in_force = (f"{summary['comm_mode']} {summary['compression']}" if summary else None) or _mode_from_log(run_dir)
    if mode_in_force is None:  # stopped at the target, before any summary: the case's own settings
        given = dict(kv.split("=", 1) for kv in CASES.get(case, []))
        mode_in_force = f"{given.get('comm.mode', 'allreduce')} {given.get('comm.compression', 'none')}"
    return {"case": case, "rate": rate, "mode": mode_in_force, "reached": reached is not None,
            "seconds": (reached["time"] if reached else trains[last]["time"]) - trains[1]["time"],
            "steps": last, "tokens": trains[last]["tokens"], "bytes_per_rank": sent,
            "exposed_share": exposed / step_seconds if step_seconds else None,
            "val_by_step": {r["step"]: r["loss"] for r in evals}, "target": target}


def _mode_from_log(run_dir: Path) -> str | None:
    log = run_dir / "logs" / "rank0.log"
    if log.exists():
        for line in log.read_text().splitlines():
            if "comm.mode auto" in line and "chose" in line:
                mode, _, codec = line.rsplit("chose ", 1)[1].partition(" with compression ")
                return f"{mode} {codec.split()[0]}" if codec else mode
    return None


def find_35(data: str, workdir: Path, probe_steps: int) -> float:
    """The link rate at which fp32 DDP's exposed communication is about 35% of its step: a probe at 100 Mbit/s
    gives the compute per step and the exposed seconds per step; exposed time scales as 1 / rate, so the rate
    follows, then one probe there corrects it."""
    rate = 100.0
    for _ in range(2):
        r = train("probe", CASES["fp32"], rate, data, probe_steps, 0, None, workdir / f"probe{rate:g}", 600)
        share = r["exposed_share"]
        step = r["seconds"] / max(1, r["steps"] - 1)
        compute, exposed = step * (1 - share), step * share
        wanted = 0.35 / 0.65 * compute
        print(f"# probe at {rate:g} Mbit/s: exposed {share:.0%} of a {step:.2f} s step", flush=True)
        if abs(share - 0.35) < 0.04:
            break
        rate = rate * exposed / wanted
    return round(rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a prepared corpus with an 8192-token vocabulary")
    ap.add_argument("--rates", default="100,auto35")
    ap.add_argument("--cases", default=",".join(c for c in CASES if c != "fp32"),
                    help="after the fp32 baseline, which always runs: " + ", ".join(CASES))
    ap.add_argument("--steps", type=int, default=120, help="the baseline's steps (a multiple of the validation "
                    f"interval and of diloco's {DILOCO_STEPS})")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--cap", type=float, default=2.0, help="a run that has not reached the target stops at this x steps")
    ap.add_argument("--target", type=float, help="fp32 DDP's validation loss at --steps from an earlier run "
                    "(deterministic for a data set and seed): skips the baseline run")
    ap.add_argument("--keep", help="keep the run directories under this folder (default: a temporary one); a "
                    "finished baseline found there is read instead of run again")
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"cannot build the emulated cluster here: {why}")
    if not (Path(args.data) / "meta.json").is_file():
        sys.exit(f"{args.data} is not prepared (rpt prepare --vocab-size 8192 ...)")
    cases = [c for c in args.cases.split(",") if c and c != "fp32"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}: choose from {', '.join(CASES)}")
    cap = int(args.steps * args.cap)
    results = []
    with tempfile.TemporaryDirectory(prefix="rpt-ttl-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for spec in args.rates.split(","):
            rate = find_35(args.data, workdir, 25) if spec == "auto35" else float(spec)
            if spec == "auto35":
                print(f"# the 35% link: {rate:g} Mbit/s", flush=True)
            if args.target is None:
                base = train("fp32", CASES["fp32"], rate, args.data, args.steps, args.eval_every, None, workdir, 3600)
                target = base["val_by_step"][args.steps]
                base.update(reached=True, target=target)
                print(f"# {rate:g} Mbit/s: fp32 DDP reached {target:.4f} at step {args.steps} in "
                      f"{base['seconds']:.0f} s", flush=True)
                results.append(base)
            else:
                target = args.target
                print(f"# {rate:g} Mbit/s: the target {target:.4f} given (fp32 DDP not run)", flush=True)
            for case in cases:
                every = DILOCO_STEPS if case == "diloco" else args.eval_every
                r = train(case, CASES[case], rate, args.data, cap, every, target, workdir, 3600, until=args.steps)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "val_by_step"}), flush=True)
    report(results, args.steps)


def report(results: list[dict], steps: int) -> None:
    print("\n| link Mbit/s | configuration | mode in force | reached | time to target s | steps | tokens | "
          "MB sent per rank | exposed comm share | val loss at the baseline's steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        at = r["val_by_step"].get(steps)
        print(f"| {r['rate']:g} | {r['case']} | {r['mode']} | {'yes' if r['reached'] else 'no'} | {r['seconds']:.0f} | "
              f"{r['steps']} | {r['tokens']:,} | {r['bytes_per_rank'] / 1e6:,.1f} | "
              f"{r['exposed_share']:.0%} | {'-' if at is None else f'{at:.4f}'} |")
    line = []
    for rate in dict.fromkeys(r["rate"] for r in results):
        bf16 = next((r for r in results if r["rate"] == rate and r["case"] == "bf16"), None)
        if bf16 is None:
            continue
        line.append(f"{rate:g} Mbit/s: " + ", ".join(
            f"{r['case']} {r['seconds'] / bf16['seconds']:.2f}x" + ("" if r["reached"] else " (not reached)")
            for r in results if r["rate"] == rate))
    print("time to target relative to bf16 DDP: " + "; ".join(line))


if __name__ == "__main__":
    main()
