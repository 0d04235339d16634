"""Does a scaling law fitted on a grid's small budgets predict its large ones? (issue 70's prediction target)

Fits `rpt scaling`'s law to the points of budgets up to --upto FLOPs only, then at every larger budget of the grid
sets the law's best size and predicted loss beside the best measured there: the loss within --tolerance bits per
byte, the size within one step of the sizes' ladder (the recipe's LADDER with the grid's own sizes between).
A measured best at the edge of the sizes run there is marked: the true best may lie beyond it. Exits 1 where a
check misses.

    .venv/bin/python benchmarks/quality/law_check.py runs/scaling-stdlib --upto 9e13
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rpt.scaling.grid import open_grid
from rpt.scaling.law import fit_law, group_key
from rpt.scaling.report import rows_of
from rpt.scaling.runner import results
from rpt.train.recipe import LADDER, lstm_params


def ladder_steps(sizes) -> list[tuple[int, int]]:
    """The recipe's ladder and the grid's sizes in one order, smallest first (by an lstm's parameters)."""
    return sorted(set(LADDER) | {tuple(s) for s in sizes}, key=lambda s: lstm_params(*s))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a grid folder of `rpt scaling run`")
    parser.add_argument("--upto", type=float, required=True, help="fit to the budgets up to these FLOPs")
    parser.add_argument("--tolerance", type=float, default=0.02, help="bits per byte (default 0.02)")
    args = parser.parse_args()

    grid = open_grid(args.folder, None)
    rows = results(args.folder, grid)
    law = fit_law(rows, grid.to_json(), args.upto)
    steps = ladder_steps(r["size"] for r in rows)
    ok, checked = True, 0
    for g in law.groups:
        mine = [r for r in rows if group_key(r) == (g.family, g.vocab, g.batch)]
        fitted = sorted({r["budget"] for r in mine if r["budget"] <= args.upto})
        print(f"{g.family}, vocabulary {g.vocab:,}, {rows_of(g)}: fitted on {len(fitted)} budgets "
              f"({', '.join(f'{b:.3g}' for b in fitted)}); L = {g.law.E:.3f} + {g.law.A:.3g}/N^{g.law.alpha:.3f} "
              f"+ {g.law.B:.3g}/D'^{g.law.beta:.3f}")
        for budget in sorted({r["budget"] for r in mine if r["budget"] > args.upto}):
            at = sorted((r for r in mine if r["budget"] == budget), key=lambda r: lstm_params(*r["size"]))
            best = min(at, key=lambda r: r["bpb"])
            edge = len(at) < 2 or best is at[0] or best is at[-1]
            f = g.frontier(budget, mine[0]["unique_tokens"])[0]
            gap = f["loss"] - best["bpb"]
            apart = abs(steps.index(tuple(f["size"])) - steps.index(tuple(best["size"])))
            loss_ok, size_ok = abs(gap) <= args.tolerance, apart <= 1
            ok &= loss_ok and size_ok
            checked += 1
            ran = ", ".join(f"{r['size'][0]}x{r['size'][1]} {r['bpb']:.4f}" for r in at)
            interval = f"[{f['low']:.4f}, {f['high']:.4f}]" if g.law.samples else "(no interval)"
            print(f"  {budget:.3g} FLOPs: measured {ran}; best {best['size'][0]}x{best['size'][1]} "
                  f"{best['bpb']:.4f}{' (at the edge of the sizes run)' if edge else ''}\n"
                  f"    law: {f['size'][0]}x{f['size'][1]} at {f['loss']:.4f} {interval}: "
                  f"loss {gap:+.4f} ({'within' if loss_ok else 'outside'} {args.tolerance}), size {apart} step(s) "
                  f"apart ({'within one' if size_ok else 'more than one'})")
    if not checked:
        print(f"no budget above {args.upto:.3g} has finished points to check")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
