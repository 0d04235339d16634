"""The scaling curve (issue 59): rpt's default recipe against the transformer peer's sizes on the embedded corpus at
budgets of 150, 300, 600 and 1,200 s, as loss against wall time and against training FLOPs.

    .venv/bin/python benchmarks/quality/scaling.py                                   the table and the targets
    .venv/bin/python benchmarks/quality/scaling.py --add W/peers.json --date D --commit C   a run's points joined
    .venv/bin/python benchmarks/quality/scaling.py --plot docs/scaling.png           the curves (the `bench` extra)

The curve takes hours of this machine, so it is measured a budget at a time (`benchmarks/quality/peers.py --cases
stdlib-1200 --peers gpt,rpt ...`) and each run's points kept in benchmarks/quality/scaling_points.json, which this script
reads: one point a run (rpt) or a size (the gpt peer), with its date and commit. A budget measured twice shows the
noise: the table gives each budget's runs, their mean, and the lead of rpt's mean over the peer's best size.
Per FLOP: the training FLOPs rpt's curve needs to reach the peer's loss at the largest budget, read off rpt's points
by interpolating log FLOPs linearly in bits per byte between the two that bracket it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

POINTS = Path(__file__).resolve().with_name("scaling_points.json")
LEAD = 0.05  # bits per byte rpt must be ahead at every budget
FLOP_SHARE = 0.7  # of the peer's FLOPs at the largest budget, the most rpt may spend to reach its loss


def points_of(peers_json: Path, date: str, commit: str) -> list[dict]:
    """A `benchmarks/quality/peers.py` results file's points: each rpt run, and each size the gpt peer ran."""
    points = []
    for case, results in json.loads(peers_json.read_text()).items():
        corpus, seconds = case.rsplit("-", 1)
        for r in results:
            if r["peer"].startswith("rpt"):
                s = r["summary"]
                cell = re.search(r"model\.cell=(\w+)", r["peer"])
                rows = [{"line": f"rpt {cell.group(1) if cell else 'lstm'} (the recipe)", "bpb": r["bpb"],
                         "wall_s": r["wall_s"], "train_flops": s["flops_per_token"] * s["tokens"],
                         "detail": r["detail"]}]
            elif r["peer"].startswith("nanoGPT"):
                rows = [{"line": f"gpt {x['peer'].split()[1]}" + (f" ({x['vocab']:,} tokens)" if "vocab" in x else ""),
                         **{k: x[k] for k in ("bpb", "wall_s", "train_flops", "detail")}}
                        for x in r.get("sizes", [r])]
            else:
                continue
            points += [{"date": date, "commit": commit, "corpus": corpus, "budget_s": int(seconds), **p} for p in rows]
    return points


def by_budget(points: list[dict], corpus: str) -> dict:
    """{budget: {line: [bpb of each run]}}."""
    table = defaultdict(lambda: defaultdict(list))
    for p in points:
        if p["corpus"] == corpus:
            table[p["budget_s"]][p["line"]].append(p)
    return table


def mean(xs) -> float:
    return sum(xs) / len(xs)


def flops_to_reach(points: list[dict], loss: float) -> float | None:
    """The training FLOPs at which a curve of (FLOPs, bpb) points reaches `loss` (log FLOPs interpolated linearly
    between the two points that bracket it), or None where none of its points is as low."""
    curve = sorted((p["train_flops"], p["bpb"]) for p in points)
    for (f0, b0), (f1, b1) in zip(curve, curve[1:]):
        if b0 > loss >= b1:
            return math.exp(math.log(f0) + (b0 - loss) / (b0 - b1) * (math.log(f1) - math.log(f0)))
    return curve[0][0] if curve and curve[0][1] <= loss else None


def report(points: list[dict], corpus: str) -> None:
    table = by_budget(points, corpus)
    leads = {}
    for budget in sorted(table):
        lines = table[budget]
        print(f"{corpus} at {budget} s")
        for line, runs in sorted(lines.items(), key=lambda kv: mean([p["bpb"] for p in kv[1]])):
            bpbs = ", ".join(f"{p['bpb']:.4f} ({p['date']} {p['commit']}, {p['train_flops']:.3g} FLOPs)" for p in runs)
            print(f"  {line:36s} {bpbs}")
        mine = [p["bpb"] for p in lines.get("rpt lstm (the recipe)", [])]
        peers = [mean([p["bpb"] for p in runs]) for line, runs in lines.items() if line.startswith("gpt")]
        if mine and peers:
            leads[budget] = min(peers) - mean(mine)
            spread = f", its runs {max(mine) - min(mine):.4f} apart" if len(mine) > 1 else ""
            print(f"  rpt's lead over the peer's best size: {leads[budget]:+.3f}{spread} "
                  f"({'met' if leads[budget] >= LEAD else 'not met'}: >= {LEAD:+.2f})")
    if len(leads) > 1:  # the target compares the largest budget's lead with the one at 300 s
        first, last = (300 if 300 in leads else min(leads)), max(leads)
        print(f"lead at {last} s {leads[last]:+.3f} against {leads[first]:+.3f} at {first} s: "
              f"{'no smaller (met)' if leads[last] >= leads[first] else 'smaller (not met)'}")
    if table:
        top = max(table)
        peers = [(mean([p["bpb"] for p in runs]), mean([p["train_flops"] for p in runs]), line)
                 for line, runs in table[top].items() if line.startswith("gpt")]
        rpt = [p for lines in table.values() for p in lines.get("rpt lstm (the recipe)", [])]
        if peers and rpt:
            loss, flops, line = min(peers)
            need, most = flops_to_reach(rpt, loss), max(p["train_flops"] for p in rpt)
            verdict = "met" if need and need <= FLOP_SHARE * flops else "not met"
            said = (f"reaches it at {need:.3g} FLOPs, {need / flops:.2f}x ({verdict}: <= {FLOP_SHARE}x)" if need else
                    f"does not reach it in any budget measured ({most:.3g} FLOPs the most, "
                    f"{most / flops:.1f}x; not met)")
            print(f"per FLOP: the peer's {top} s loss {loss:.4f} ({line}, {flops:.3g} FLOPs); rpt {said}")


def law_frontier(law_path: Path, flops: list[float]) -> list[tuple[float, float]]:
    """(FLOPs, predicted bits per byte) of a law's frontier (the best of its sizes at each budget), on the corpus
    the law was fitted to (its first group's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rpt.scaling.law import Law

    law = Law.load(law_path)
    group = law.groups[0]
    unique = next(p["unique_tokens"] for p in law.points if p["family"] == group.family)
    return [(c, group.frontier(c, unique)[0]["loss"]) for c in flops]


def plot(points: list[dict], corpus: str, out: Path, law: Path | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    for p in points:
        if p["corpus"] == corpus:
            lines[p["line"]].append(p)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for line, ps in sorted(lines.items()):
        by_budget = defaultdict(list)
        for p in ps:
            by_budget[p["budget_s"]].append(p)
        budgets = sorted(by_budget)  # a line through each budget's mean; every run a point (the noise)
        style = dict(linewidth=2.5) if line.startswith("rpt") else dict(linestyle="--")
        for ax, x in zip(axes, ("budget_s", "train_flops")):
            drawn = ax.plot([mean([p[x] for p in by_budget[b]]) for b in budgets],
                            [mean([p["bpb"] for p in by_budget[b]]) for b in budgets], label=line, **style)
            ax.scatter([p[x] for p in ps], [p["bpb"] for p in ps], color=drawn[0].get_color(), s=18,
                       marker="o" if line.startswith("rpt") else "s")
    if law is not None:  # the law's predicted frontier beside the measured points
        import numpy as np

        drawn = [p["train_flops"] for p in points if p["corpus"] == corpus]
        frontier = law_frontier(law, list(np.geomspace(min(drawn), max(drawn), 40)))
        axes[1].plot(*zip(*frontier), "k:", linewidth=2, label=f"the law's frontier ({law.name})")
        axes[1].legend(fontsize=8)
    for ax, label in zip(axes, ("training budget, s (2-core CPU)", "training FLOPs")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(True, which="both", alpha=0.3)
    budgets = sorted({p["budget_s"] for p in points if p["corpus"] == corpus})
    axes[0].set_xticks(budgets, [str(b) for b in budgets], minor=False)
    axes[0].set_xticks([], minor=True)
    axes[0].set_ylabel("validation bits per byte")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"rpt's default recipe against nanoGPT's sizes, {corpus} (benchmarks/quality/scaling.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"drew {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=Path, default=POINTS)
    parser.add_argument("--add", type=Path, help="a benchmarks/quality/peers.py results file whose points to join")
    parser.add_argument("--date", help="the run's date (with --add)")
    parser.add_argument("--commit", help="the commit it ran (with --add)")
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--plot", type=Path, help="draw the curves into this PNG")
    parser.add_argument("--law", type=Path, help="with --plot: draw this scaling law's frontier (rpt scaling fit)")
    args = parser.parse_args()
    points = json.loads(args.points.read_text()) if args.points.exists() else []
    if args.add:
        if not (args.date and args.commit):
            parser.error("--add needs --date and --commit: a point is known by them")
        points += points_of(args.add, args.date, args.commit)
        args.points.write_text(json.dumps(points, indent=1) + "\n")
    report(points, args.corpus)
    if args.plot:
        plot(points, args.corpus, args.plot, args.law)


if __name__ == "__main__":
    main()
