"""The package's floors, read from the source: the ground floor never imports Lightning, no cycles of
modules or of packages, the stage sources and the techniques apart (they meet in the stage view), no
module imports another package's private module, and none the test harness (``_testing.py``), which the
tests and the experiments share (one port picker; the experiments import no test module); the
configuration matrix (``tests/matrix.py``) reads the techniques from their list alone.

Pure ``ast`` (nothing is imported), milliseconds. Imports under ``if TYPE_CHECKING:`` count too: a cycle
that only type checkers follow still makes two modules one concept.
"""

import ast
from pathlib import Path

import lightning_parallel

PACKAGE = Path(lightning_parallel.__file__).parent
GROUND_FLOOR = (
    "layout",
    "optim",
    "plan",
    "pipeline",
    "sources",
    "planner",
    "memory",
    "techniques",
    "grads",
    "timeline",
    "distributed",
    "io",
    "data",
    "checkpoint",
)
UPPER_FLOOR = ("lightning_parallel.callbacks", "lightning_parallel.strategies")


def _module_name(path: Path) -> str:
    parts = ["lightning_parallel", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from a import b`` gives ``a`` and ``a.b``)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    imports = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    return {m: {d for d in deps if d in imports and d != m} for m, deps in imports.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for dep in sorted(graph[node]):
            if dep == start:
                return [*path, start]
            if dep not in seen and dep != "lightning_parallel":  # the package root re-exports all
                seen.add(dep)
                stack.append((dep, [*path, dep]))
    return None


def test_the_ground_floor_imports_neither_lightning_nor_the_upper_floor():
    offending = {}
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] not in GROUND_FLOOR:
            continue
        bad = sorted(
            d
            for d in _imports(path)
            if d.split(".")[0] == "lightning" or d == "lightning_parallel" or d.startswith(UPPER_FLOOR)
        )
        if bad:
            offending[_module_name(path)] = bad
    assert not offending, f"ground-floor modules import Lightning or the upper floor: {offending}"


def test_no_two_modules_import_each_other():
    graph = _graph()
    assert "lightning_parallel.callbacks._metrics_internals" in graph  # the walk found the package
    cycles = [
        cycle for m in sorted(graph) if m != "lightning_parallel" and (cycle := _cycle_through(graph, m))
    ]
    assert not cycles, f"import cycles: {cycles[:3]}"


def _package(module: str) -> str:
    """The top-level package of a module (``lightning_parallel.sources.traced.split`` -> ``sources``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def test_no_two_packages_import_each_other():
    """The floors are packages too: the layout below the pipeline's runtime below the techniques below the
    plan (ParallelPlan folds TECHNIQUES) below the stage sources below the planner, ..."""
    graph: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        here = _package(module)
        if here:
            graph.setdefault(here, set()).update(p for d in deps if (p := _package(d)) and p != here)
    expected = {"layout", "plan", "pipeline", "techniques", "sources", "planner", "grads", "timeline"}
    assert expected <= set(graph)
    cycles = [cycle for p in sorted(graph) if (cycle := _cycle_through(graph, p))]
    assert not cycles, f"package import cycles: {cycles[:3]}"


def test_the_sources_and_the_techniques_meet_only_in_the_stage_view():
    """A stage source imports no technique and a technique no source: the techniques act on the stages
    through ``pipeline/stage_source.py`` (the same verbs on both sources), so a technique is one module
    whatever splits the model, and a source serves every technique."""
    offending = []
    for module, deps in _graph().items():
        for here, other in (("sources", "techniques"), ("techniques", "sources")):
            if _package(module) == here:
                offending += [f"{module} imports {d}" for d in sorted(deps) if _package(d) == other]
    assert not offending, offending


def test_no_module_imports_another_packages_private_module():
    """``pipeline._v_forward`` is the pipeline package's own; the root's (``_options``) every package's."""
    offending = []
    for path in PACKAGE.rglob("*.py"):
        here = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
        for dep in _imports(path):
            parts = dep.split(".")
            private = next((i for i, part in enumerate(parts) if part.startswith("_") and i > 0), None)
            if (
                private is None
                or not (PACKAGE.parent / "/".join(parts[: private + 1])).with_suffix(".py").exists()
            ):
                continue
            owner = ".".join(parts[:private])
            if not (here == owner or owner == "lightning_parallel"):
                offending.append(f"{_module_name(path)} imports {dep}")
    assert not offending, offending


def test_the_test_harness_is_imported_by_no_module_of_the_package():
    """``_testing.py`` (the ports, the spawned ranks, the quiet Trainer) is the one harness of the tests and
    the experiments: the package ships it beside the code it exercises, and never runs it."""
    graph = _graph()
    assert "lightning_parallel._testing" in graph
    offending = sorted(m for m, deps in graph.items() if "lightning_parallel._testing" in deps)
    assert not offending, f"package modules import the test harness: {offending}"


def _source_imports(path: Path) -> set[str]:
    """The absolute modules a file outside the package imports (``from a import b``: ``a``, ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_one_harness_for_the_tests_and_the_experiments():
    """The ports (a slice per pytest worker), the spawned ranks and the quiet Trainer are written once, in
    ``_testing.py``: no test or experiment picks its own port, and the experiments import no test module
    (``tests/`` and ``experiments/`` meet only in the package)."""
    root = PACKAGE.parent
    own_ports = [
        p.relative_to(root).as_posix()
        for folder in ("tests", "experiments")
        for p in sorted((root / folder).rglob("*.py"))
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "free_port"
            for node in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert not own_ports, (
        f"{own_ports} pick their own ports: import free_port from lightning_parallel._testing"
    )
    test_modules = {p.stem for p in (root / "tests").glob("*.py")} - {"conftest"}
    crossing = {
        p.name: sorted(m for m in _source_imports(p) if m.split(".")[0] in test_modules)
        for p in sorted((root / "experiments").glob("*.py"))
    }
    assert not {k: v for k, v in crossing.items() if v}, crossing


def test_the_matrix_reads_the_techniques_from_their_list():
    """``tests/matrix.py`` chooses the configurations from ``TECHNIQUES`` and the contract alone (each
    technique's ``variants()``, plus ``NOT_SEARCHED``): it names no technique module, so a new technique
    reaches the matrix through the list, not through an edit of the chooser (its checks, in
    ``matrix_checks.py``, may name it)."""
    imported = _source_imports(PACKAGE.parent / "tests" / "matrix.py")
    techniques = sorted(m for m in imported if m.startswith("lightning_parallel.techniques"))
    assert techniques, "tests/matrix.py should read lightning_parallel.techniques.TECHNIQUES"
    others = [
        m
        for m in techniques
        if m not in ("lightning_parallel.techniques", "lightning_parallel.techniques.TECHNIQUES")
        and not m.startswith("lightning_parallel.techniques.contract")
    ]
    assert not others, f"tests/matrix.py names technique modules {others}: read them from TECHNIQUES"
