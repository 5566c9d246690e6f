"""Every module is named by a test, and no experiment script imports another.

A module of ``lightning_parallel/`` is *named by a test* when a test file imports it or mentions it, by
its path in the package (``strategies/pipeline/step.py``) or by its dotted name. So a reader holding a
module can find the tests that exercise it with one grep.

An experiment script (a ``.py`` file directly in ``experiments/`` whose name does not start with ``_``,
other than the shared ``models.py`` and ``hf_decoders.py``) is run on its own: the code two scripts
share lives in a helper module (``_harness.py``, ``_meters.py``, ``models.py``, ...), never in a script.

The map of ``docs/how-it-works.md`` names every folder of the package (``offload/``), so a folder
moved or added shows on the page a newcomer reads first.

Pure ``ast`` and text (nothing of the package is imported), milliseconds.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_parallel"
TESTS = ROOT / "tests"
EXPERIMENTS = ROOT / "experiments"
# Shared helpers of the experiments, not scripts: the rest of experiments/ may import them.
EXPERIMENT_HELPERS = {"models", "hf_decoders"}  # and every module whose name starts with "_"


def _test_files() -> list[Path]:
    """The test files (``test_*.py`` and ``conftest.py``), except this one, whose text names modules."""
    files = [*TESTS.rglob("test_*.py"), *TESTS.rglob("conftest.py")]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def _imported(tree: ast.AST) -> set[str]:
    """The absolute modules a file imports (``from a import b`` gives ``a`` and ``a.b``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _is_named(relative: str, dotted: str, texts: list[str], imported: set[str]) -> bool:
    if dotted in imported:
        return True
    by_path = re.compile(rf"(?<![\w./])(?:lightning_parallel/)?{re.escape(relative)}(?!\w)")
    by_name = re.compile(rf"(?<![\w.]){re.escape(dotted)}(?!\w)")
    return any(by_path.search(t) or by_name.search(t) for t in texts)


def test_every_module_is_named_by_a_test():
    texts = [p.read_text() for p in _test_files()]
    imported = set().union(*(_imported(ast.parse(t)) for t in texts))
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        dotted = ".".join(["lightning_parallel", *path.relative_to(PACKAGE).with_suffix("").parts])
        if not _is_named(relative, dotted, texts, imported):
            unnamed.append(relative)
    assert not unnamed, (
        f"{len(unnamed)} modules are named by no test: {unnamed}. Name each in the docstring of the "
        "test file that exercises it (e.g. 'Covers strategies/pipeline/step.py through ...'), "
        "or add a test file for it."
    )


def test_the_map_names_every_folder_of_the_package():
    page = (ROOT / "docs" / "how-it-works.md").read_text()
    assert page.count("```") >= 2, "docs/how-it-works.md lost its map (the first ``` block)"
    the_map = page.split("```")[1]
    folders = sorted(
        p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
    )
    assert len(folders) > 10
    unnamed = [f for f in folders if not re.search(rf"(?<![\w/]){re.escape(f.rsplit('/', 1)[-1])}/", the_map)]
    assert not unnamed, (
        f"the map of docs/how-it-works.md does not name {unnamed}: add each folder (as 'name/') where it "
        "sits, with what it holds"
    )


def _is_script(path: Path) -> bool:
    return not path.name.startswith("_") and path.stem not in EXPERIMENT_HELPERS


def test_no_experiment_script_imports_another():
    scripts = {p.stem for p in EXPERIMENTS.glob("*.py") if _is_script(p)}
    offending = {}
    for path in sorted(EXPERIMENTS.glob("*.py")):
        if not _is_script(path):
            continue
        imported = {m.split(".")[0] for m in _imported(ast.parse(path.read_text()))}
        others = sorted((imported & scripts) - {path.stem})
        if others:
            offending[path.name] = others
    assert not offending, (
        f"experiment scripts import other scripts: {offending}. Move what they share into a helper "
        "module (experiments/_*.py) and import it from there."
    )
