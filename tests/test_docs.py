"""The documentation's links and commands point at things that exist.

The pages are README.md, docs/*.md and experiments/README.md. Every relative link (and image) must name
an existing file, and a ``#anchor`` into a Markdown page one of its headings, as GitHub spells anchors.
Every ``python path/to/script.py``, ``python -m module`` and ``make target`` named in a code block or a
code span must refer to a script, a runnable module or a Makefile target of this repository. The README's
headline results must show the numbers of the docs/results.md section each row links to.

Pure text (nothing is run or imported from the package), milliseconds.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
# Files the pages name as the reader's own, not this repository's (LightningCLI's page runs `main.py`).
READERS_FILES = {"main.py"}

FENCE = ("```", "~~~")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
SCHEME = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")
MAKE_TARGET = re.compile(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", re.M)


def pages(root: Path = ROOT) -> list[Path]:
    """The documentation: the README, every page under docs/, and the experiments' guide."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "experiments" / "README.md"]


# ------------------------------------------------------------------------------------ Markdown


def split_code(text: str) -> tuple[str, list[str]]:
    """``text`` without its fenced code blocks (blank lines in their place), and those blocks."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith(FENCE):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def code_texts(text: str) -> list[str]:
    """Every fenced block and every code span (`` `...` ``, one line even where it wraps) of a page."""
    prose, blocks = split_code(text)
    return blocks + [" ".join(m.group(2).split()) for m in CODE_SPAN.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").replace("**", "").lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in split_code(text)[0].splitlines():
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_targets(text: str) -> list[str]:
    """The targets of a page's links, images and link references, outside code."""
    prose = CODE_SPAN.sub("code", split_code(text)[0])
    return [m.group(1) for m in LINK.finditer(prose)] + REFERENCE.findall(prose)


# ----------------------------------------------------------------------------------- the checks


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose heading anchor, does not exist."""
    problems = []
    for target in link_targets(page.read_text()):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    return problems


def _segments(code: str) -> list[list[str]]:
    """The shell words of each command in ``code``; comments are read as commands too."""
    words = []
    for segment in re.split(r"\n|&&|\|\||;|\||#", code.replace("\\\n", " ")):
        try:
            words.append(shlex.split(segment))
        except ValueError:  # an unbalanced quote in prose or Python: words split on spaces
            words.append(segment.split())
    return words


def _python(words: list[str]) -> list[tuple[str, str]]:
    """``python`` (or any path to it), options, then ``-m module`` or ``script.py``, anywhere in ``words``."""
    found = []
    for i, word in enumerate(words):
        if re.fullmatch(r"(?:\S*/)?python3?", word):
            rest = words[i + 1 :]
            while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
                rest = rest[1:]
            if len(rest) >= 2 and rest[0] == "-m":
                found.append(("module", rest[1]))
            elif rest and rest[0].endswith(".py"):
                found.append(("script", rest[0]))
    return found


def _make(words: list[str]) -> list[tuple[str, str]]:
    """``make`` and its targets, where it starts the command (after ``VAR=value`` words or a label
    such as ``or:``): "make" elsewhere is a word of a sentence."""
    start = 0
    while start < len(words) and ("=" in words[start] or words[start].endswith(":")):
        start += 1
    if start == len(words) or words[start] != "make":
        return []
    return [("make", w) for w in words[start + 1 :] if not w.startswith("-") and "=" not in w]


def commands(code: str) -> list[tuple[str, str]]:
    """``("script", path)``, ``("module", name)`` and ``("make", target)`` for each command ``code`` names."""
    return [found for words in _segments(code) for found in _python(words) + _make(words)]


def module_exists(name: str, root: Path) -> bool:
    """Whether ``python -m name`` finds something to run: this repository's module or package
    ``__main__``, else an installed or standard-library module (found, not imported)."""
    parts = name.split(".")
    if (root / parts[0]).is_dir() or (root / f"{parts[0]}.py").is_file():
        local = root.joinpath(*parts)
        return local.with_suffix(".py").is_file() or (local / "__main__.py").is_file()
    return parts[0] in sys.stdlib_module_names or importlib.util.find_spec(parts[0]) is not None


def make_targets(root: Path) -> set[str]:
    text = (root / "Makefile").read_text()
    return {t for m in MAKE_TARGET.finditer(text) for t in m.group(1).split()} - {".PHONY"}


def missing_commands(page: Path, root: Path = ROOT) -> list[str]:
    """Each command of ``page`` whose script, module or make target does not exist (paths from ``root``)."""
    targets, problems = make_targets(root), []
    for code in code_texts(page.read_text()):
        for kind, name in commands(code):
            if kind == "script" and name not in READERS_FILES and not (root / name).is_file():
                problems.append(f"python {name}: no such file")
            elif kind == "module" and not module_exists(name, root):
                problems.append(f"python -m {name}: no such module (or no __main__ in the package)")
            elif kind == "make" and name not in targets:
                problems.append(f"make {name}: no such target in the Makefile")
    return problems


def section(text: str, anchor: str) -> str:
    """The text under the heading with ``anchor``, up to the next heading of the same or a higher level."""
    lines = split_code(text)[0].splitlines()
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        if m and slug(m.group(2)) == anchor:
            level, body = len(m.group(1)), []
            for rest in lines[i + 1 :]:
                n = HEADING.match(rest)
                if n and len(n.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise KeyError(anchor)


def unsupported_headline_numbers(readme: str, results: str) -> list[str]:
    """Each number of a README headline row that the docs/results.md section it links to does not show."""
    problems, rows = [], 0
    for line in section(readme, "results").splitlines():
        link = re.search(r"\]\(docs/results\.md#([^)]+)\)", line)
        if not line.startswith("|") or not link:
            continue
        rows += 1
        shown = set(NUMBER.findall(section(results, link.group(1))))
        text = re.sub(r"\]\([^)]*\)", "]", line)  # link targets are not numbers
        problems += [f"#{link.group(1)}: {n}" for n in NUMBER.findall(text) if n not in shown]
    return problems if rows else ["the README's Results section has no row linking to docs/results.md"]


# ------------------------------------------------------------------------------------------ tests


def test_every_relative_link_and_anchor_exists():
    problems = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in pages()}
    assert {page: p for page, p in problems.items() if p} == {}


def test_every_command_names_an_existing_script_module_or_make_target():
    problems = {page.relative_to(ROOT).as_posix(): missing_commands(page) for page in pages()}
    assert {page: p for page, p in problems.items() if p} == {}
    readme = commands("\n".join(code_texts((ROOT / "README.md").read_text())))
    assert ("make", "test") in readme, "CI runs the README's test command (.ci/run): the README names it"


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    readme = {Path(t).name for t in link_targets((ROOT / "README.md").read_text()) if t.startswith("docs/")}
    index = {t.partition("#")[0] for t in link_targets((ROOT / "docs" / "README.md").read_text())}
    assert docs - readme == set(), "pages the README does not link to"
    assert docs - index == set(), "pages docs/README.md does not list"


def test_the_readme_headline_shows_the_numbers_of_the_results_it_links_to():
    # The headline is typed by hand; docs/results.md is rebuilt by `make experiments`. When a rebuild
    # changes a number, this names it: copy the new value from the linked section into the README.
    readme, results = (ROOT / "README.md").read_text(), (ROOT / "docs" / "results.md").read_text()
    assert unsupported_headline_numbers(readme, results) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "Makefile").write_text(".PHONY: demo\ndemo: $(VENV)/.installed\n\tpython run.py\n")
    (tmp_path / "run.py").write_text("")
    (tmp_path / "pkg" / "cli").mkdir(parents=True)
    (tmp_path / "pkg" / "cli" / "__main__.py").write_text("")
    (tmp_path / "pkg" / "lib.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "topic.md").write_text("# A topic: `compile=True`\n\n## Part\n\n## Part\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "[ok](docs/topic.md#a-topic-compiletrue) [ok](docs/topic.md#part-1) [ok](#title) [web](https://x.org/y)\n"
        "[gone](docs/missing.md) [bad anchor](docs/topic.md#part-2) ![img](docs/missing.png) [self](#nope)\n"
        "`[not a link](nowhere.md)` and `python run.py`, `python -m pkg.cli`, `python -m json.tool`\n\n"
        '```bash\nmake demo && python -u run.py   # or: make FOO="a b" demo\n'
        "python gone.py; python -m pkg\nOMP_NUM_THREADS=1 make nothing\n```\n"
        "`python -m pkg.absent` and `make\nmissing`\n"
    )
    assert broken_links(page) == [
        f"docs/missing.md: no file {tmp_path / 'docs' / 'missing.md'}",
        "docs/topic.md#part-2: no heading with anchor #part-2 in topic.md",
        f"docs/missing.png: no file {tmp_path / 'docs' / 'missing.png'}",
        "#nope: no heading with anchor #nope in README.md",
    ]
    assert missing_commands(page, tmp_path) == [
        "python gone.py: no such file",
        "python -m pkg: no such module (or no __main__ in the package)",
        "make nothing: no such target in the Makefile",
        "python -m pkg.absent: no such module (or no __main__ in the package)",
        "make missing: no such target in the Makefile",
    ]
    readme = "## Results\n\n| x | y |\n|---|---|\n| [a](docs/results.md#a): 2 ranks | 0.97 (0.84 .. 1.00) |\n"
    results = "# Results\n\n## A\n\n| 0.97 (0.84 .. 1.00) | 2 |\n\n## B\n\n0.5\n"
    assert unsupported_headline_numbers(readme, results) == []
    assert unsupported_headline_numbers(readme.replace("0.97", "0.5"), results) == ["#a: 0.5"]
