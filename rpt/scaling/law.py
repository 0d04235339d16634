"""A fitted scaling law as a file: per group of the grid (family, vocabulary, rows a step), approach 3's
L(N, D') and approach 2's vertices, with the provenance a reader needs to trust or refuse it (rpt's commit, the
grid, the machine, each corpus's size and hash, the points it was fitted to).

Units: the loss is bits per byte of the validation split (comparable across vocabularies), N the parameters beside
the embedding and head, D training tokens, C training FLOPs (forward and backward, counted once).
"""

from __future__ import annotations

import datetime
import json
import platform
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rpt.errors import RptError
from rpt.runtime.version import rpt_commit
from rpt.scaling.fit import Law3, Vertex, budget_vertex, effective_tokens, fit_approach3, power_law

FORMAT = "rpt-law/1"


def group_key(row: dict) -> tuple:
    return row["family"], row["vocab"], row["batch"]


@dataclass
class Group:
    """The law of one family at one vocabulary and batch."""

    family: str
    vocab: int
    batch: int
    law: Law3
    sizes: dict  # (n_layers, d_model) -> {"n": N, "flops_per_token": FLOPs}
    vertices: list  # approach 2: [{"flops", "n_opt", "loss", "inside"}]
    n_opt_power: tuple | None  # approach 2: (k, a) of N_opt = k C^a

    def predict(self, n: float, tokens: float, unique: float) -> tuple[float, float, float]:
        """(loss, low, high) for N parameters trained on `tokens` of `unique` distinct ones."""
        d_eff = float(effective_tokens(tokens, unique))
        low, high = self.law.interval(n, d_eff)
        return float(self.law.loss(n, d_eff)), low, high

    def frontier(self, flops: float, unique: float) -> list[dict]:
        """Each size of the grid at a budget: its tokens, passes and predicted loss, the best first."""
        rows = []
        for size, s in self.sizes.items():
            tokens = flops / s["flops_per_token"]
            loss, low, high = self.predict(s["n"], tokens, unique)
            rows.append({"size": size, "n": s["n"], "tokens": tokens, "passes": tokens / unique, "loss": loss,
                         "low": low, "high": high})
        return sorted(rows, key=lambda r: r["loss"])

    def as_dict(self) -> dict:
        return {"family": self.family, "vocab": self.vocab, "batch": self.batch, "approach3": self.law.as_dict(),
                "sizes": [{"size": list(k), **v} for k, v in self.sizes.items()], "approach2": self.vertices,
                "n_opt_power": list(self.n_opt_power) if self.n_opt_power else None}

    @classmethod
    def from_dict(cls, d: dict) -> "Group":
        return cls(d["family"], d["vocab"], d["batch"], Law3.from_dict(d["approach3"]),
                   {tuple(s["size"]): {"n": s["n"], "flops_per_token": s["flops_per_token"]} for s in d["sizes"]},
                   d["approach2"], tuple(d["n_opt_power"]) if d.get("n_opt_power") else None)


@dataclass
class Law:
    groups: list
    provenance: dict
    points: list

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": FORMAT, "units": {
            "loss": "bits per byte of the validation split", "N": "parameters beside the embedding and head",
            "D": "training tokens", "C": "training FLOPs (forward and backward, counted once)"},
            "provenance": self.provenance, "groups": [g.as_dict() for g in self.groups], "points": self.points},
            indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Law":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise RptError(f"cannot read the scaling law {path}: {exc}",
                           "give a law.json that `rpt scaling fit` wrote") from None
        if d.get("format") != FORMAT:
            raise RptError(f"{path} is not a scaling law of this rpt (format {d.get('format')!r}, not {FORMAT!r})",
                           "fit it again with `rpt scaling fit`")
        return cls([Group.from_dict(g) for g in d["groups"]], d["provenance"], d.get("points", []))

    def group(self, family: str, vocab: int | None = None) -> Group | None:
        """The family's group, at the vocabulary nearest `vocab` (in log) where the law holds several."""
        mine = [g for g in self.groups if g.family == family]
        if not mine:
            return None
        return min(mine, key=lambda g: abs(np.log(g.vocab / vocab)) if vocab else 0.0)


def fit_law(rows: list[dict], grid: dict, upto: float = 0.0, bootstrap: int = 100) -> Law:
    """The law of a grid's finished points (`rows`, rpt/scaling/runner.py's results), those of budgets up to
    `upto` FLOPs only where given (a law fitted on the small budgets, to be checked on the large)."""
    used = [r for r in rows if not upto or r["budget"] <= upto]
    by_group = defaultdict(list)
    for r in used:
        by_group[group_key(r)].append(r)
    groups, skipped = [], []
    for (family, vocab, batch), rs in sorted(by_group.items()):
        try:
            law = fit_approach3([r["n"] for r in rs], [r["tokens"] for r in rs], [r["unique_tokens"] for r in rs],
                                [r["bpb"] for r in rs], bootstrap=bootstrap)
        except ValueError as exc:
            skipped.append(f"{family} at {vocab:,} tokens, {batch} rows: {exc}")
            continue
        vertices = []
        for budget in sorted({r["budget"] for r in rs}):
            at = [r for r in rs if r["budget"] == budget]
            v = budget_vertex(budget, [r["n"] for r in at], [r["bpb"] for r in at])
            if v is not None:
                vertices.append({"flops": v.flops, "n_opt": v.n_opt, "loss": v.loss, "inside": v.inside})
        power = power_law([Vertex(**v) for v in vertices])
        sizes = {}
        for r in rs:
            sizes[tuple(r["size"])] = {"n": r["n"], "flops_per_token": r["flops_per_token"]}
        groups.append(Group(family, vocab, batch, law, dict(sorted(sizes.items(), key=lambda kv: kv[1]["n"])),
                            vertices, power))
    if not groups:
        raise RptError("no group of the grid has enough finished points to fit a law (5 or more: "
                       + "; ".join(skipped) + ")", "run more of the grid first")
    return Law(groups, provenance(grid, used, upto, skipped), rows)


def provenance(grid: dict, used: list[dict], upto: float, skipped: list[str]) -> dict:
    from rpt.runtime.peak import device_name

    corpora = {}
    for data in sorted({d for block in grid["blocks"] for d in block["data"]}):
        meta = json.loads((Path(data) / "meta.json").read_text())
        train = meta["splits"]["train"]
        corpora[Path(data).name] = {"path": data, "vocab": meta["vocab_size"], "train_tokens": train["tokens"],
                                    "train_bytes": train["bytes"], "train_sha256": train.get("sha256")}
    return {"rpt_commit": rpt_commit(), "runs_rpt_commits": sorted({str(r.get("rpt_commit")) for r in used}),
            "date": datetime.date.today().isoformat(),
            "machine": device_name(torch.device("cpu")), "platform": platform.platform(), "torch": torch.__version__,
            "grid": grid, "corpora": corpora, "points_fitted": len(used),
            "budgets_fitted": sorted({r["budget"] for r in used}), "upto_flops": upto or None,
            "groups_left_out": skipped}
