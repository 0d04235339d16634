"""A scaling grid: every combination of prepared corpus, family, size, batch and training-FLOP budget, each point a
plain `rpt train` command with its own run folder under the grid's folder.

A point is trained as the default recipe would train it: the recipe runs (no --config), and the grid gives only
the data, the family, the size, the rows a step (where the grid names them) and `train.max_flops`; the recipe
chooses the rest (regularisation by the passes the budget makes, validation, warm-up). FLOP budgets make the grid
alike on any machine and under any load: a point's result does not depend on how fast it ran. The grid is saved
as grid.json in its folder, so a later call (another process, another machine sharing the folder) runs the same
points; a call with other flags adds its points to the grid (a budget's own sizes); a point whose summary holds a
final evaluation is done and never rerun.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rpt.errors import RptError

GRID_FILE = "grid.json"
DEFAULT_SIZES = ((2, 128), (2, 192), (2, 256), (2, 384), (2, 512))  # the recipe's ladder (rpt/train/recipe.py), its CPU end


@dataclass(frozen=True)
class Point:
    """One run of the grid."""

    data: str
    family: str
    n_layers: int
    d_model: int
    batch: int  # 0: the recipe's choice
    flops: float
    sets: tuple = ()

    @property
    def name(self) -> str:
        batch = f"-b{self.batch}" if self.batch else ""
        corpus = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.data).name)
        return f"{corpus}-{self.family}-{self.n_layers}x{self.d_model}{batch}-{self.flops:.3g}".replace("+", "")

    def overrides(self) -> list[str]:
        given = [f"data.path={self.data}", f"model.cell={self.family}", f"model.n_layers={self.n_layers}",
                 f"model.d_model={self.d_model}", f"train.max_flops={self.flops:.6g}"]
        return given + ([f"train.batch_size={self.batch}"] if self.batch else []) + list(self.sets)

    def command(self, run_dir: Path, rpt: tuple[str, ...] = ("rpt",)) -> list[str]:
        return [*rpt, "train", "--run-dir", str(run_dir), *(a for o in self.overrides() for a in ("--set", o))]


@dataclass
class Grid:
    data: list[str]
    budgets: list[float]
    families: list[str] = field(default_factory=lambda: ["lstm"])
    sizes: list[tuple[int, int]] = field(default_factory=lambda: [tuple(s) for s in DEFAULT_SIZES])
    batches: list[int] = field(default_factory=lambda: [0])
    sets: list[str] = field(default_factory=list)

    def check(self) -> None:
        if not self.data:
            raise RptError("a scaling grid needs prepared data", "name it with --data DIR (`rpt prepare` writes one)")
        for d in self.data:
            if not (Path(d) / "meta.json").is_file():
                raise RptError(f"--data {d} is not a prepared corpus (no meta.json there)",
                               f"prepare it first: rpt prepare TEXT --out {d}")
        if not self.budgets or any(b <= 0 for b in self.budgets):
            raise RptError("a scaling grid needs training-FLOP budgets above 0", "e.g. --budgets 1e13,3e13,1e14")
        for s in self.sets:
            key = s.split("=", 1)[0].strip()
            if key in {"data.path", "model.cell", "model.n_layers", "model.d_model", "train.max_flops"} or \
                    key.startswith("train.max_"):
                raise RptError(f"--set {s}: the grid sets {key} for each point itself",
                               "give it with the grid's own flags (--data, --families, --sizes, --budgets)")

    def points(self) -> list[Point]:
        """Every point, the smallest budgets first (a fit can start before the largest have run)."""
        return [Point(d, f, n, w, b, c, tuple(self.sets)) for c in sorted(self.budgets) for d in self.data
                for f in self.families for b in self.batches for n, w in self.sizes]

    def to_json(self) -> dict:
        return {k: [list(v) if isinstance(v, tuple) else v for v in vs] for k, vs in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict) -> "Grid":
        return cls(data=list(d["data"]), budgets=[float(b) for b in d["budgets"]], families=list(d["families"]),
                   sizes=[tuple(s) for s in d["sizes"]], batches=[int(b) for b in d["batches"]],
                   sets=list(d.get("sets", [])))


class Grids(list):
    """A folder's grid: the blocks added to it, one a `rpt scaling run` with flags new to it (a budget's own sizes:
    a grid need not be every size at every budget, and the smallest sizes at the largest budgets cost the most)."""

    def points(self) -> list[Point]:
        """Every block's points once, the smallest budgets first."""
        unique = {p.name: p for block in self for p in block.points()}
        return sorted(unique.values(), key=lambda p: p.flops)

    def data(self) -> list[str]:
        return sorted({d for block in self for d in block.data})

    def check_sizes(self) -> None:
        """Three sizes or more at each budget (of each corpus, family and batch), over all blocks: a budget's
        compute-optimal size is a parabola's vertex. A block may add one size to a budget that has three."""
        sizes = {}
        for p in self.points():
            sizes.setdefault((p.data, p.family, p.batch, p.flops), set()).add((p.n_layers, p.d_model))
        for (data, family, batch, flops), have in sizes.items():
            if len(have) < 3:
                raise RptError(f"{len(have)} size(s) at {flops:.3g} FLOPs ({family} on {data}): a budget's "
                               "compute-optimal size is a parabola's vertex, which needs three sizes or more",
                               "e.g. --sizes 2x128,2x256,2x512")

    def to_json(self) -> dict:
        return {"blocks": [block.to_json() for block in self]}


def open_grid(folder: Path, given: Grid | None, out=None) -> Grids:
    """The grid of `folder` (saved in its grid.json), with `given` (from the command's flags) added where it is new;
    a new grid where the folder holds none."""
    path = folder / GRID_FILE
    saved = Grids(Grid.from_json(b) for b in json.loads(path.read_text())["blocks"]) if path.is_file() else Grids()
    if given is None:
        if not saved:
            raise RptError(f"{folder} holds no scaling grid (no {GRID_FILE})",
                           "start one with --data DIR --budgets C1,C2,... (training FLOPs)")
        return saved
    given.check()
    if given.to_json() in [b.to_json() for b in saved]:
        return saved
    Grids([*saved, given]).check_sizes()
    if saved and given.sets != saved[0].sets:
        raise RptError(f"{folder}'s grid trains with --set {' '.join(saved[0].sets) or '(none)'}, not "
                       f"{' '.join(given.sets) or '(none)'}: its points would not be alike",
                       "give the same --set flags, or choose another folder")
    before = len(saved.points())
    grids = Grids([*saved, given])
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(grids.to_json(), indent=1) + "\n")
    if saved and out is not None:
        print(f"added {len(grids.points()) - before} point(s) to the grid in {folder}", file=out)
    return grids


def run_dir(folder: Path, point: Point) -> Path:
    return folder / "points" / point.name


def finished(folder: Path, point: Point) -> dict | None:
    """The point's summary where its run finished with a final evaluation, else None."""
    try:
        summary = json.loads((run_dir(folder, point) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("val_bpb") is not None and not summary.get("interrupted") else None


def shell_line(folder: Path, point: Point) -> str:
    return shlex.join(point.command(run_dir(folder, point)))


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'2x128,2x256' -> [(2, 128), (2, 256)]."""
    try:
        sizes = [tuple(int(v) for v in s.lower().split("x", 1)) for s in text.split(",") if s.strip()]
        if any(len(s) != 2 or min(s) < 1 for s in sizes):
            raise ValueError
        return sizes
    except ValueError:
        raise RptError(f"--sizes {text!r}: each size is LAYERSxWIDTH", "e.g. --sizes 2x128,2x256,2x512") from None


def parse_budgets(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RptError(f"--budgets {text!r}: training FLOPs, comma-separated", "e.g. --budgets 1e13,3e13,1e14") from None
