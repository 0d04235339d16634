"""Imports between rpt's packages run one way (docs/architecture.md): cli -> train -> parallel -> comm; models
import no parallel, comm or train; kernels (the cells' fast paths) nothing of rpt's but themselves; comm no
parallel or train; parallel no train; ops (the recurrences: their specs, which export ships, and forms) nothing of
rpt's but the kernels' shared pieces; and no cycles. Imports inside
functions count too: they are the ones that creep in."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import rpt

ROOT = Path(rpt.__file__).parent
FORBIDDEN = {"models": {"parallel", "comm", "train"}, "kernels": {"models", "parallel", "comm", "train", "data"},
             "runtime": {"models", "parallel", "comm", "train", "data", "ops", "export", "monitor"},
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


def test_fault_injection_reaches_the_loop_only_through_the_cli():
    """rpt/testing (fault injection) is installed by `rpt train` (rpt/cli.py) when RPT_FAULT asks: no package of
    the real loop imports it."""
    edges = import_edges()
    assert ("cli", "testing") in edges  # the graph is really read
    wrong = {f"{a} -> testing ({', '.join(sorted(set(files)))})" for (a, b), files in edges.items()
             if b == "testing" and a != "cli"}
    assert not wrong, wrong


def test_serving_reads_the_run_loader_and_never_the_training_loop():
    """rpt/serve imports models, data and train/run_dir.py (load_run) only of the training side: no trainer, no
    parallel or comm (docs/architecture.md)."""
    used = set()
    for path in (ROOT / "serve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rpt."):
                used.add(node.module)
    assert "rpt.train.run_dir" in used and "rpt.serve.engine" in used  # the imports are really read
    wrong = sorted(m for m in used if m.split(".")[1] in ("parallel", "comm", "monitor")
                   or (m.startswith("rpt.train") and m != "rpt.train.run_dir"))
    assert not wrong, wrong


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


RUNNER_NAMES = 8  # the most names of the runner the trainer may call (rpt/parallel/runner.py lists them)


def of(node: ast.Attribute, *holders: str) -> bool:
    """Whether `node` is holder.x or self.holder.x for one of `holders`."""
    v = node.value
    return (isinstance(v, ast.Name) and v.id in holders) or (isinstance(v, ast.Attribute) and v.attr in holders)


def test_the_trainer_holds_one_handle_on_the_model_and_no_pipeline_branch():
    """The trainer reaches the running model only through the runner that parallelize returns, and neither the
    trainer nor its telemetry names a pipeline, a stage or the sync object: those are the runner's (and what it
    reports, the layout and the step record, says of them)."""
    def of_runner(node: ast.Attribute) -> bool:  # runner.x, self.runner.x, layout.x, record.x: the runner's words
        return of(node, "runner", "layout", "record")

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


def test_the_trainer_calls_few_runner_names_and_reaches_through_none():
    """The runner is a narrow face: the trainer calls at most RUNNER_NAMES of its names, and no file of rpt/train
    reaches through it (runner.model.x, self.runner.optimizer.y) or holds it but the trainer."""
    trainer = ast.parse((ROOT / "train" / "trainer.py").read_text())
    called = {n.attr for n in ast.walk(trainer) if isinstance(n, ast.Attribute) and of(n, "runner")}
    assert "train_step" in called and len(called) <= RUNNER_NAMES, sorted(called)
    for path in sorted((ROOT / "train").rglob("*.py")):
        tree = ast.parse(path.read_text())
        through = {f"runner.{n.value.attr}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Attribute) and of(n.value, "runner")}
        assert not through, f"{path.relative_to(ROOT)} reaches through the runner: {sorted(through)}"
        if path.name != "trainer.py":
            assert not any(isinstance(n, ast.Attribute) and of(n, "runner") for n in ast.walk(tree)), path.name


def test_telemetry_and_checkpointing_take_narrow_faces():
    """Telemetry is built from its own section, the immutable Layout and the probe's modules (never the runner,
    the trainer or the whole configuration), and reads nothing but them and the records it is handed;
    checkpointing's save and resume take no model, optimiser or parts: its one state provider holds them."""
    from rpt.train.checkpoint.manager import Checkpointing
    from rpt.train.telemetry import Telemetry

    assert list(inspect.signature(Telemetry).parameters) == ["cfg", "layout", "run_dir", "probes", "show_progress"]
    source = (ROOT / "train" / "telemetry.py").read_text()
    tree = ast.parse(source)
    sections = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and of(n, "cfg")}
    assert sections <= {"log_interval", "profile", "tensorboard", "wandb"}, sections  # the monitor section's keys
    assert not {"runner", "trainer"} & {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for method, params in (("save", ["self", "step", "val"]), ("finish", ["self", "step", "val"]),
                           ("resume", ["self"]), ("select_best", ["self", "step", "best", "best_weights"])):
        assert list(inspect.signature(getattr(Checkpointing, method)).parameters) == params, method


# The readers of the whole configuration (a parameter named cfg that reaches two or more of its sections, or one
# section by name): each with its reason. Every other function takes its section or the values it needs.
WHOLE_CONFIG = {
    "train/resolve.py": "resolves the user's configuration against the data and the world, once",
    "train/recipe.py": "the default recipe: a part of resolving, choosing values of several sections",
    "train/trainer.py": "builds the run from the resolved configuration and hands each component its section",
    "parallel/apply.py": "builds the runner: the stage, the pieces of each window, data parallelism",
    "parallel/plan.py": "`rpt plan`: the parallel plan of a configuration, without running it",
    "parallel/topology_command.py": "`rpt topology`: the model's gradient bytes, as `rpt plan` counts them",
    "export/hf_export.py": "the export's config: a run's model section and its data's end-of-text token",
}
SECTIONS = {"data", "model", "train", "checkpoint", "comm", "parallel", "monitor"}


def whole_config_readers() -> dict[str, set[str]]:
    """file -> the functions in it that read sections of a parameter named cfg (the whole Config)."""
    found: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "cfg"
                    and n.attr in SECTIONS and "cfg" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}
                    for n in ast.walk(fn)):
                found.setdefault(str(path.relative_to(ROOT)), set()).add(fn.name)
    return found


def test_only_the_named_readers_take_the_whole_configuration():
    found = whole_config_readers()
    assert "train/resolve.py" in found  # really read
    extra = {f"{path}: {sorted(fns)}" for path, fns in found.items() if path not in WHOLE_CONFIG}
    assert not extra, f"these take the whole Config: pass their section or the values they need ({extra})"


def test_a_family_is_its_own_folder():
    """A recurrent family (rpt/ops/NAME and rpt/models/cells/NAME.py) is imported only from its own files and the
    registry of cells (rpt/models/cells/__init__.py): context parallelism, the plan and the trainer reach it through
    the cell's interface (piece_forward, summary_numbers, state_shapes), never by name. The exceptions are named
    here: modlstm's gate table, which the registry of gates and the export read. The export reaches a family by
    its cell's `export_spec`: rpt/export/hf holds no file of any family's (tests/export checks what it ships)."""
    known = {"modlstm": {"rpt/export/hf_export.py", "rpt/models/registry.py"}}
    families = [p.name for p in (ROOT / "ops").iterdir() if (p / "spec.py").exists() and p.name not in ("stack", "loop")]
    assert {"lstm", "mlstm", "minrnn", "gdn"} <= set(families)  # the folders are really read
    wrong = {}
    for path in ROOT.rglob("*.py"):
        if path.is_symlink():  # the export's copies of the spec files
            continue
        rel = f"rpt/{path.relative_to(ROOT)}"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for family in families:
                own = rel.startswith(f"rpt/ops/{family}/") or rel in (f"rpt/models/cells/{family}.py",
                                                                      "rpt/models/cells/__init__.py")
                if not own and rel not in known.get(family, ()) and any(
                        n.startswith((f"rpt.ops.{family}.", f"rpt.models.cells.{family}")) or n == f"rpt.ops.{family}"
                        for n in names):
                    wrong.setdefault(family, set()).add(rel)
    assert not wrong, wrong
    hf = ROOT / "export" / "hf"
    assert not [p.name for p in hf.iterdir() if any(f in p.name for f in families)], "a family's file in export/hf"
