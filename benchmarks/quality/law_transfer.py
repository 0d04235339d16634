"""Would a law fitted on another corpus size runs on this one as this corpus's own law does? (issue 70: "choose
nothing for the embedded corpus that a law fitted on another corpus would not also choose")

For each budget of a grid (and any --budgets beside), the size the grid's own law chooses, the size another
corpus's law (--law, its law.json) chooses for this corpus (its loss function over this grid's sizes, their
FLOPs a token and this corpus's distinct tokens), and the best size measured there; agreement is within one step
of the sizes' ladder (law_check.py's). Exits 1 where the two laws' choices are more than a step apart.

    .venv/bin/python benchmarks/quality/law_transfer.py runs/scaling-stdlib --law runs/scaling-kdocs/law.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from law_check import ladder_steps
from rpt.scaling.grid import open_grid
from rpt.scaling.law import Law, fit_law, group_key
from rpt.scaling.runner import results


def choice(group, sizes: dict, budget: float, unique: float) -> tuple[tuple, float]:
    """The size of `sizes` ({size: {"n", "flops_per_token"}}) with the least loss `group`'s law predicts."""
    losses = {size: group.predict(s["n"], budget / s["flops_per_token"], unique)[0] for size, s in sizes.items()}
    best = min(losses, key=losses.get)
    return best, losses[best]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a grid folder of `rpt scaling run` (this corpus)")
    parser.add_argument("--law", type=Path, required=True, help="another corpus's law.json (`rpt scaling fit`)")
    parser.add_argument("--budgets", default="", help="more budgets in FLOPs, comma-separated")
    args = parser.parse_args()

    grid = open_grid(args.folder, None)
    rows = results(args.folder, grid)
    own, other = fit_law(rows, grid.to_json()), Law.load(args.law)
    steps = ladder_steps(r["size"] for r in rows)
    extra = [float(b) for b in args.budgets.split(",") if b]
    print(f"other law: {args.law} (fitted on {', '.join(other.provenance.get('corpora', []))})")
    ok = True
    for g in own.groups:
        theirs = other.group(g.family, g.vocab)
        if theirs is None:
            print(f"{g.family}: the other law holds no {g.family} runs")
            continue
        mine = [r for r in rows if group_key(r) == (g.family, g.vocab, g.batch)]
        unique = mine[0]["unique_tokens"]
        print(f"{g.family}, vocabulary {g.vocab:,}: this corpus {unique:,} distinct training tokens; "
              f"other law L = {theirs.law.E:.3f} + {theirs.law.A:.3g}/N^{theirs.law.alpha:.3f} + "
              f"{theirs.law.B:.3g}/D'^{theirs.law.beta:.3f}")
        print("| budget (FLOPs) | best measured | own law's choice | other law's choice | steps apart |")
        print("|---|---|---|---|---|")
        for budget in sorted({r["budget"] for r in mine} | set(extra)):
            at = [r for r in mine if r["budget"] == budget]
            measured = min(at, key=lambda r: r["bpb"]) if at else None
            a, _ = choice(g, g.sizes, budget, unique)
            b, _ = choice(theirs, g.sizes, budget, unique)
            apart = abs(steps.index(tuple(a)) - steps.index(tuple(b)))
            ok &= apart <= 1
            shown = f"{measured['size'][0]}x{measured['size'][1]} {measured['bpb']:.4f}" if measured else "-"
            print(f"| {budget:.3g} | {shown} | {a[0]}x{a[1]} | {b[0]}x{b[1]} | {apart} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
