"""Every repository file a tracked file names (code, docs, configs, pyproject.toml, the Makefile) exists: a moved or
renamed file leaves no stale path behind. Not paths: placeholders (`rpt/ops/CELL/spec.py`), patterns, and
benchmarks/results/*.md, whose rows name the files of their own commit."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = "train|models|parallel|comm|ops|kernels|data|monitor|export"  # rpt's own, named without rpt/
NAMED = re.compile(rf"(?<![\w./-])((?:rpt|tests|benchmarks|docs|configs|\.ci|{PACKAGES})/[\w./-]*\w\."
                   r"(?:py|cpp|h|md|toml|js|html|css|json|sh|png|txt|yaml))(?![\w/*])")
READ = (".py", ".cpp", ".h", ".md", ".toml", ".js", ".html", ".css", ".sh")
HISTORY = {"benchmarks/RESULTS.md",
           *(f"benchmarks/results/{p.name}" for p in (ROOT / "benchmarks" / "results").glob("*.md"))}


def named_paths(text: str) -> set[str]:
    """The repository paths `text` names, placeholders (an upper-case segment: CELL) left out; a path in one of rpt's
    packages named without rpt/ (`train/recipe.py`) counts where it names source."""
    return {p for p in NAMED.findall(text) if not any(part.isupper() for part in re.split(r"[/._-]", p)) and
            (p.endswith((".py", ".cpp", ".h")) or not re.match(PACKAGES, p))}  # data/web/tokenizer.json: a user's


def test_the_pattern_finds_paths_and_skips_placeholders():
    text = ("see rpt/ops/mlstm/spec.py, (docs/cells.md), `train/recipe.py` and rpt/ops/CELL/spec.py or "
            "rpt/ops/*/spec.py; a.rpt/x.py")
    assert named_paths(text) == {"rpt/ops/mlstm/spec.py", "docs/cells.md", "train/recipe.py"}


def test_every_file_path_named_in_the_repository_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = {}
    for name in tracked:
        if name in HISTORY or not (name.endswith(READ) or name in ("Makefile", ".ci/run")):
            continue
        path = ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        for named in named_paths(path.read_text(encoding="utf8", errors="replace")):
            if not ((ROOT / named).exists() or (ROOT / "rpt" / named).exists()):
                missing.setdefault(named, []).append(name)
    assert not missing, "stale paths (named -> where): " + "; ".join(f"{k} -> {', '.join(v)}"
                                                                    for k, v in missing.items())


def test_every_entry_of_the_architecture_map_exists():
    """docs/architecture.md's layout: each line's first name, under the folders of the lines above it at smaller
    indentation, is a file or folder of the repository (CELL: each op folder's)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("```", 2)[1].splitlines()[1:]
    folders: list[tuple[int, str]] = []  # (indentation, folder) of the enclosing entries
    checked = 0
    for line in tree:
        name = line.strip().split(" ")[0].rstrip(",")
        if not name or not ("." in name or name.endswith("/")):
            continue  # a line continuing the one above
        depth = len(line) - len(line.lstrip())
        folders = [(d, f) for d, f in folders if d < depth]
        base = "/".join(f.rstrip("/") for _, f in folders)
        path = f"{base}/{name}" if base else name
        ops = [p.name for p in (ROOT / "rpt" / "ops").iterdir() if p.is_dir() and not p.name.startswith("_")]
        if "CELL" in path:  # every op has its spec; the other files, some ops (in at least one)
            concrete = [path.replace("CELL", op) for op in ops if op != "loop"]
            found = [c for c in concrete if (ROOT / c).exists()]
            assert found if not path.endswith("spec.py") else found == concrete, f"docs/architecture.md: {path}"
        else:
            assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"
        checked += 1
        if name.endswith("/"):
            folders.append((depth, name))
    assert checked > 50  # the map was really read


def test_the_benchmarks_index_lists_every_script():
    """benchmarks/README.md names every script under benchmarks/ (and names none that is gone: the test above)."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*")
               if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts]
    assert len(scripts) > 20
    assert not [s for s in scripts if s not in index], "scripts missing from benchmarks/README.md"


def test_no_test_can_read_the_folder_beside_the_checkout():
    """tests/conftest.py refuses any file opened under ../shared (a user's clone has none): opening one there fails
    whether or not the folder exists, and a file of the repository still opens."""
    import pytest

    with pytest.raises(RuntimeError, match="tests read only the repository"):
        open(ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    with pytest.raises(RuntimeError, match="tests read only the repository"):
        (ROOT / ".." / "shared" / "DESIGN.md").read_text()
    assert (ROOT / "README.md").read_text()
