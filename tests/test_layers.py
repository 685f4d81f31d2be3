"""The package's layers: every import among membench's packages goes down, never up or sideways, and no package
cycle exists (module-level and function-level imports alike: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A package may import its own modules and those of any package of a lower rank; packages of one
# rank are independent of each other (a strategy knows no workload, measurement knows neither).
LAYERS = {
    "bench.core": 0,
    "strategies": 1, "workloads": 1, "bench.measure": 1,
    "bench.run": 2,
    "bench.analysis": 3, "bench.jobs": 3,  # a trainer's configuration read as a case: beside the analysis
    "bench.report": 4,
    "bench.cli": 5,
}
TOP_LEVEL = {"bench": 0, "bench.__main__": 6}  # bench/__init__.py imports nothing; `python -m bench` runs the CLI


def package_of(module: str) -> str:
    """The layer package a module belongs to (`bench.run.runner` -> `bench.run`, `strategies.amp` -> `strategies`)."""
    if module in TOP_LEVEL:
        return module
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "bench" else parts[0]


def rank_of(package: str) -> int:
    return TOP_LEVEL[package] if package in TOP_LEVEL else LAYERS[package]


def modules() -> dict[str, Path]:
    found = {}
    for top in ("bench", "strategies", "workloads"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its file (`from x import y` counts y when y is a module)."""
    targets = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        targets.update(name for name in names if name in known)
    return targets


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports that make that edge."""
    known = modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in known.items():
        for target in imported(module, path, known):
            source_package, target_package = package_of(module), package_of(target)
            if source_package != target_package:
                edges.setdefault((source_package, target_package), []).append(f"{module} -> {target}")
    return edges


def test_every_module_is_in_a_layer():
    unplaced = sorted({package_of(m) for m in modules()} - set(LAYERS) - set(TOP_LEVEL))
    assert not unplaced, f"give these packages a rank in LAYERS: {unplaced}"


def test_imports_only_go_down():
    wrong = [imports for (source, target), imports in package_edges().items() if rank_of(target) >= rank_of(source)]
    assert not wrong, "imports that go up or sideways between layers: " + "; ".join(sum(wrong, []))


def test_no_package_level_cycle():
    edges = {}
    for source, target in package_edges():
        edges.setdefault(source, set()).add(target)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(package for package in edges if package in reachable(package))
    assert not cycles, f"packages that reach themselves through their imports: {cycles}"


@pytest.mark.parametrize("package", sorted(p for p in LAYERS if p.startswith("bench.")))
def test_each_layer_says_what_it_holds(package):
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert docstring and len(docstring.split()) >= 5, f"{init}: a first-line docstring saying what the layer holds"


def test_every_module_says_what_it_is_for():
    missing = [name for name, path in modules().items() if not ast.get_docstring(ast.parse(path.read_text("utf-8")))]
    assert not missing, f"modules without a first docstring line: {missing}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk is not vacuous: a measurement module importing the runner is caught."""
    fake_root = tmp_path / "repo"
    for top in ("bench/measure", "bench/run", "strategies", "workloads"):
        (fake_root / top).mkdir(parents=True)
    (fake_root / "bench" / "__init__.py").write_text('"""x"""\n')
    (fake_root / "bench" / "run" / "__init__.py").write_text('"""x"""\n')
    (fake_root / "bench" / "run" / "runner.py").write_text('"""x"""\n')
    (fake_root / "bench" / "measure" / "__init__.py").write_text('"""x"""\n')
    (fake_root / "bench" / "measure" / "timing.py").write_text('"""x"""\ndef f():\n    from bench.run import runner\n')
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    assert ("bench.measure", "bench.run") in package_edges()
