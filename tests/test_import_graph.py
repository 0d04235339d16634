"""Imports between rpt's packages run one way (../shared/DESIGN.md): cli -> train -> parallel -> comm; models
import no parallel, comm or train; kernels (the cells' fast paths) nothing of rpt's but themselves; comm no
parallel or train; parallel no train; ops (the recurrences: their specs, which export ships, and forms) nothing of
rpt's but the kernels' shared pieces; and no cycles. Imports inside
functions count too: they are the ones that creep in."""

from __future__ import annotations

import ast
from pathlib import Path

import rpt

ROOT = Path(rpt.__file__).parent
FORBIDDEN = {"models": {"parallel", "comm", "train"}, "kernels": {"models", "parallel", "comm", "train", "data"},
             "ops": {"models", "parallel", "comm", "train", "data", "monitor", "export"},
             "comm": {"parallel", "train"}, "parallel": {"train"}}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rpt" and len(parts) > 1 else None


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files where that happens."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        here = rel.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                there = package_of(name)
                if there and there != here:
                    edges.setdefault((here, there), []).append(str(rel))
    return edges


def test_packages_import_one_way():
    edges = import_edges()
    assert ("train", "parallel") in edges and ("parallel", "comm") in edges  # the graph is really read
    assert ("models", "kernels") in edges
    wrong = {f"{a} -> {b} ({', '.join(sorted(set(files)))})" for (a, b), files in edges.items()
             if b in FORBIDDEN.get(a, ())}
    assert not wrong, wrong
    cycles = {f"{a} <-> {b}" for (a, b) in edges if (b, a) in edges and a < b}
    assert not cycles, cycles


def test_models_hold_no_branch_for_how_they_are_run():
    """Parallelism is applied from outside (rpt/parallel/apply.py): nothing in rpt/models reads the settings of
    activation checkpointing, compile, pipelines or data parallelism, nor the train/parallel/comm sections."""
    touched = ("activation_checkpointing", "torch.utils.checkpoint", ".compile(", "cfg.train", "cfg.parallel",
               "cfg.comm", "torch.distributed")
    wrong = {f"{path.relative_to(ROOT)}: {token}" for path in (ROOT / "models").rglob("*.py")
             for token in touched if token in path.read_text()}
    assert not wrong, wrong
    assert "activation_checkpointing" in (ROOT / "parallel" / "apply.py").read_text()  # read where it belongs


def test_no_function_in_rpt_runs_past_about_80_lines():
    """A function a reader cannot hold in one screen is split (issue 21): at most 80 lines, docstring included."""
    long = {f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in ROOT.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80}
    assert not long, long


def module_edges() -> dict[str, set[str]]:
    """rpt module -> the rpt modules it imports (at the top or inside functions). `from rpt.a import b` names the
    module rpt.a.b where that is a file, else the package rpt.a (its __init__)."""
    def module_name(path: Path) -> str:
        parts = ("rpt",) + path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    known = {module_name(p) for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        here = module_name(path)
        targets = edges.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
                targets.update(subs or [node.module])
        targets.discard(here)
    return edges


def cycles_of(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_modules():
    edges = module_edges()
    assert "rpt.comm.gradient_sync" in edges["rpt.comm.diloco"]  # the graph is really read, to the module
    assert cycles_of({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # and a circle would be found
    assert not cycles_of(edges), cycles_of(edges)


def test_the_trainer_holds_one_handle_on_the_model_and_no_pipeline_branch():
    """The trainer reaches the running model only through the runner that parallelize returns, and neither the
    trainer nor its telemetry names a pipeline, a stage or the sync object: those are the runner's."""
    def of_runner(node: ast.Attribute) -> bool:  # runner.x, self.runner.x: what the runner reports is its own
        v = node.value
        return (isinstance(v, ast.Name) and v.id == "runner") or (isinstance(v, ast.Attribute) and v.attr == "runner")

    def names(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and not of_runner(n)}

    trainer, telemetry = ROOT / "train" / "trainer.py", ROOT / "train" / "telemetry.py"
    assert {"runner", "train_step", "telemetry"} <= names(trainer) | names(telemetry)  # the files are really read
    for path in (trainer, telemetry):
        wrong = {n for n in names(path) if "pipe" in n.lower() or "stage" in n.lower()} | ({"sync", "module"} & names(path))
        assert not wrong, f"{path.name}: {sorted(wrong)}"
    held = {n.attr for n in ast.walk(ast.parse(trainer.read_text())) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert "runner" in held and not {"model", "sync", "pipe", "optimizer", "scaler", "checkpointer"} & held
