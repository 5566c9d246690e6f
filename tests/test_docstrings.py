"""The docstrings' examples: ``>>>`` ones run (doctest), every other ``Example::`` block is valid Python."""

import ast
import doctest
import importlib
import pkgutil
import re
import textwrap

import pytest

import lightning_parallel

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(lightning_parallel.__path__, "lightning_parallel.")
    if not m.name.endswith("__main__") or m.name == "lightning_parallel.planner.__main__"
)


def _docstrings(module) -> list[tuple[str, str]]:
    finder = doctest.DocTestFinder(exclude_empty=False)
    return [(t.name, t.docstring) for t in finder.find(module) if t.docstring]


@pytest.mark.parametrize("name", MODULES)
def test_doctests_pass(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples of {name} failed"


def _example_blocks(docstring: str) -> list[str]:
    """The indented literal blocks after ``Example::`` lines."""
    blocks = []
    for match in re.finditer(r"Example::\n\s*\n((?:[ \t]+\S.*\n|[ \t]*\n)+)", docstring + "\n"):
        blocks.append(textwrap.dedent(match.group(1)))
    return blocks


@pytest.mark.parametrize("name", MODULES)
def test_other_examples_are_valid_python(name):
    module = importlib.import_module(name)
    bad = []
    for where, docstring in _docstrings(module):
        for block in _example_blocks(docstring):
            if ">>>" in block:
                continue  # run by doctest
            try:
                ast.parse(block)
            except SyntaxError as err:
                bad.append(f"{where}: {err}")
    assert not bad, bad
