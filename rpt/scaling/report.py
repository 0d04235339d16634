"""A law's table (per group and budget: the best size measured, approach 2's vertex, approach 3's best size of the
grid with its tokens, passes and predicted loss) and its figure (loss against training FLOPs: the points, each
size's predicted curve, the frontier)."""

from __future__ import annotations

from pathlib import Path

from rpt.scaling.law import Law, group_key


def fmt_n(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def rows_of(g) -> str:
    return f"{g.batch} rows a step" if g.batch else "the recipe's rows a step"


def table(law: Law, budgets: list[float] | None = None) -> str:
    """Markdown: each group's frontier at the grid's budgets (and any further `budgets`)."""
    lines = []
    for g in law.groups:
        mine = [p for p in law.points if group_key(p) == (g.family, g.vocab, g.batch)]
        unique = mine[0]["unique_tokens"]
        L = g.law
        lines += [f"{g.family}, {g.vocab:,}-token vocabulary, {rows_of(g)}: L = {L.E:.3f} + {L.A:.3g} / "
                  f"N^{L.alpha:.3f} + {L.B:.3g} / D'^{L.beta:.3f} (bits per byte; "
                  f"{f'{len(L.samples)} bootstrap fits' if L.samples else 'no interval: as many points as parameters'})",
                  "", "| budget (FLOPs) | best measured | approach 2: N_opt | approach 3: best size | tokens | passes "
                  "| predicted bits/byte [90%] | measured there |", "|---|---|---|---|---|---|---|---|"]
        vertices = {v["flops"]: v for v in g.vertices}
        for budget in sorted({p["budget"] for p in mine} | set(budgets or [])):
            at = [p for p in mine if p["budget"] == budget]
            best = min(at, key=lambda p: p["bpb"]) if at else None
            v = vertices.get(budget)
            vertex = (f"{fmt_n(v['n_opt'])}" + ("" if v["inside"] else " (edge)")) if v else (
                f"{fmt_n(g.n_opt_power[0] * budget ** g.n_opt_power[1])} (power law)" if g.n_opt_power else "-")
            f = g.frontier(budget, unique)[0]
            measured = f"{best['size'][0]}x{best['size'][1]}: {best['bpb']:.4f}" if best else "-"
            there = next((p["bpb"] for p in at if tuple(p["size"]) == f["size"]), None)
            lines.append(f"| {budget:.3g} | {measured} "
                         f"| {vertex} | {f['size'][0]}x{f['size'][1]} ({fmt_n(f['n'])}) | {f['tokens']:,.0f} | "
                         f"{f['passes']:.2f} | {f['loss']:.4f} [{f['low']:.4f}, {f['high']:.4f}] | "
                         f"{'-' if there is None else round(there, 4)} |")
        lines.append("")
    return "\n".join(lines)


def plot(law: Law, path: Path, budgets: list[float] | None = None) -> None:
    """Loss against training FLOPs, one panel per group (matplotlib: the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(law.groups), figsize=(6.5 * len(law.groups), 4.5), squeeze=False)
    for ax, g in zip(axes[0], law.groups):
        mine = [p for p in law.points if group_key(p) == (g.family, g.vocab, g.batch)]
        unique = mine[0]["unique_tokens"]
        budgets_all = sorted({p["budget"] for p in mine} | set(budgets or []))
        span = np.geomspace(min(budgets_all) / 1.5, max(budgets_all) * 1.5, 60)
        for size, s in g.sizes.items():
            curve = [g.predict(s["n"], c / s["flops_per_token"], unique)[0] for c in span]
            line, = ax.plot(span, curve, lw=1, alpha=0.7, label=f"{size[0]}x{size[1]} (law)")
            pts = [p for p in mine if tuple(p["size"]) == size]
            ax.scatter([p["train_flops"] for p in pts], [p["bpb"] for p in pts], color=line.get_color(), s=18)
        ax.plot(span, [g.frontier(c, unique)[0]["loss"] for c in span], "k--", lw=1.5, label="frontier (law)")
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("validation bits per byte")
        ax.set_title(f"{g.family}, vocabulary {g.vocab:,}, {rows_of(g)}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
