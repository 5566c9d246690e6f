"""The documentation's links and commands point at things that exist, and its Python runs as pasted.

The pages are README.md, docs/*.md and experiments/README.md. Every relative link (and image) must name
an existing file, and a ``#anchor`` into a Markdown page one of its headings, as GitHub spells anchors.
Every ``python path/to/script.py``, ``python -m module`` and ``make target`` named in a code block or a
code span must refer to a script, a runnable module or a Makefile target of this repository. The README's
headline results must show the numbers of the docs/results.md section each row links to.

Each page's ```python blocks, in order, are one program (see "the pages' programs" below): every block
compiles and reads only names the page defines before it (pure text, milliseconds), and each page's
program runs on the CPU as ``python program.py`` runs it, a Trainer of 2 devices on 2 processes
(seconds; transformers and peft from .hf_packages for the pages that say `pip install` them), printing
the outputs the page quotes.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import re
import runpy
import shlex
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import hf_env
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from mp_harness import START_METHOD, free_port

ROOT = Path(__file__).resolve().parent.parent
HF_PACKAGES = hf_env.HF_PACKAGES
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


# ---------------------------------------------------------------------------- the pages' programs
#
# A page's ```python blocks, in order, are one program: what a reader who pastes them gets. A block that
# cannot run on this machine says why in an HTML comment on the line before its fence (invisible on the
# rendered page): `<!-- not run: needs 8 GPUs -->`; the program then keeps only its imports, and the block
# must still compile and read only names that the page's earlier blocks (or itself) define. A quoted
# output that the program prints carries `<!-- output -->`: the program must print it as quoted. (One
# that a ```bash command above it prints, `<!-- output of the command above -->`, is pasted from a
# fresh run by experiments/refresh_outputs.py: its timings are the machine's, no test can check them.)

MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
NOT_RUN = re.compile(r"not run: \S.*")
OUTPUT = "output"
COMMAND_OUTPUT = "output of the command above"  # experiments/refresh_outputs.py's


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its fence's line (from 1), language, code, and the marker before it."""

    line: int
    lang: str
    code: str
    marker: str

    @property
    def runs(self) -> bool:
        return not NOT_RUN.fullmatch(self.marker)


def fenced_blocks(text: str) -> list[Block]:
    """The page's fenced blocks, each dedented by its fence's indent (a block inside a list item)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith(FENCE):
            i += 1
            continue
        indent, fence, body = len(lines[i]) - len(stripped), stripped[:3], []
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith(fence):
            line = lines[j]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            j += 1
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.match(before)
        found.append(Block(i + 1, stripped[3:].strip(), "\n".join(body), marker.group(1) if marker else ""))
        i = j + 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [b for b in fenced_blocks(page.read_text()) if b.lang == "python"]


def marker_problems(page: Path) -> list[str]:
    """Each marker the test would not understand: a misspelt one would silently run or skip a block."""
    problems = []
    for b in fenced_blocks(page.read_text()):
        known = NOT_RUN.fullmatch(b.marker) if b.lang == "python" else b.marker in (OUTPUT, COMMAND_OUTPUT)
        if b.marker and not known:
            problems.append(f"line {b.line}: unknown marker <!-- {b.marker} --> before a ```{b.lang} block")
    return problems


def _global_reads(table: symtable.SymbolTable, top: bool) -> set[str]:
    """The names ``table`` and its nested scopes read from the module's namespace."""
    reads = {s.get_name() for s in table.get_symbols() if s.is_referenced() and (top or s.is_global())}
    for child in table.get_children():
        reads |= _global_reads(child, top=False)
    return reads


def block_names(code: str, where: str = "<block>") -> tuple[set[str], set[str]]:
    """(the names a block binds in the module's namespace, the module names it reads); SyntaxError if
    it does not compile."""
    table = symtable.symtable(code, where, "exec")
    binds = {
        s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    return binds, _global_reads(table, top=True)


def undefined_names(page: Path) -> list[str]:
    """Each python block that does not compile, or reads a name that neither the page's earlier blocks
    nor the block itself define (a builtin aside)."""
    defined, problems = set(dir(builtins)), []
    for b in python_blocks(page):
        try:
            binds, reads = block_names(b.code, f"{page.name}:{b.line}")
        except SyntaxError as err:
            problems.append(f"line {b.line}: does not compile: {err.msg} (its line {err.lineno})")
            continue
        missing = sorted(reads - binds - defined)
        if missing:
            problems.append(
                f"line {b.line}: {', '.join(missing)} not defined by this block or an earlier one"
            )
        defined |= binds
    return problems


def imports_of(code: str) -> str:
    """The top-level import statements of ``code``."""
    return "\n".join(
        ast.get_source_segment(code, node)
        for node in ast.parse(code).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def program(page: Path, root: Path = ROOT) -> str:
    """The page's python blocks as one program (a block marked not run: its imports only)."""
    parts = []
    for b in python_blocks(page):
        where = f"# {page.relative_to(root).as_posix()}, line {b.line}"
        parts.append(
            f"{where}\n{b.code}\n" if b.runs else f"{where} ({b.marker}): its imports\n{imports_of(b.code)}\n"
        )
    return "\n".join(parts)


def quoted_outputs(page: Path) -> list[Block]:
    return [b for b in fenced_blocks(page.read_text()) if b.lang != "python" and b.marker == OUTPUT]


def unprinted(quoted: str, printed: str) -> bool:
    """Whether the quoted lines are not a run of consecutive printed lines (trailing spaces aside)."""
    want = [line.rstrip() for line in quoted.splitlines()]
    have = [line.rstrip() for line in printed.splitlines()]
    return not any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def refreshed(text: str, block: Block, printed: str) -> str:
    """``text`` with ``block`` (a quoted output) replaced by as many printed lines, from the first printed
    line equal to its first line (its header, which a change of numbers leaves alone); ``text`` itself
    when that line is not printed."""
    quoted = block.code.splitlines()
    have = [line.rstrip() for line in printed.splitlines()]
    if not quoted or quoted[0].rstrip() not in have:
        return text
    start = have.index(quoted[0].rstrip())
    lines = text.splitlines(keepends=True)
    lines[block.line : block.line + len(quoted)] = [line + "\n" for line in have[start : start + len(quoted)]]
    return "".join(lines)


# ------------------------------------------------------------------------------------------ tests


def test_every_relative_link_and_anchor_exists():
    problems = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in pages()}
    assert {page: p for page, p in problems.items() if p} == {}


def test_every_command_names_an_existing_script_module_or_make_target():
    problems = {page.relative_to(ROOT).as_posix(): missing_commands(page) for page in pages()}
    assert {page: p for page, p in problems.items() if p} == {}
    readme = commands("\n".join(code_texts((ROOT / "README.md").read_text())))
    assert ("make", "test") in readme, "CI runs the README's test command (.ci/run): the README names it"


def test_every_docs_page_and_notebook_is_linked_from_the_readme_and_the_index():
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    readme = {Path(t).name for t in link_targets((ROOT / "README.md").read_text()) if t.startswith("docs/")}
    index = {t.partition("#")[0] for t in link_targets((ROOT / "docs" / "README.md").read_text())}
    assert docs - readme == set(), "pages the README does not link to"
    assert docs - index == set(), "pages docs/README.md does not list"
    notebooks = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    for page in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        linked = {Path(t).name for t in link_targets(page.read_text())}
        assert notebooks - linked == set(), f"notebooks {page.relative_to(ROOT)} does not link to"


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


def test_every_python_block_compiles_and_reads_only_names_its_page_defines():
    problems = {p.relative_to(ROOT).as_posix(): undefined_names(p) + marker_problems(p) for p in pages()}
    assert {page: p for page, p in problems.items() if p} == {}


def _run_page(_rank: int, workdir: str, environ: dict[str, str]) -> None:
    """A page's program (``workdir/program.py``, run from ``workdir``), its output in ``workdir/printed.txt``.

    As ``python program.py`` runs it, in a process forked from the suite's preloaded server (no imports
    to pay); a Trainer on several devices starts the other ranks as Lightning's launcher does, by running
    ``program.py`` again (their output goes to the same file)."""
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(environ)
    with open("printed.txt", "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        # Whole lines, one write each: the other ranks write to the same file, and a forked process's
        # stdout may write a print's text and its newline apart (another rank's line then lands between).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the rank's stdout to its end)
        try:
            runpy.run_path("program.py", run_name="__main__")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page", [p for p in pages() if python_blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_each_page_runs_as_pasted(page, tmp_path):
    # The page's python blocks, in order, as a reader pastes them into a script and runs it. The main
    # process is forked from the suite's preloaded server (no imports to pay); a page that trains on 2
    # devices pays its second process's imports (~7 CPU s), as Lightning's launcher starts it afresh.
    text = program(page)
    hf = [p for p in ("transformers", "peft") if re.search(rf"^(from|import) {p}\b", text, re.M)]
    for package in hf:
        hf_env.require(package)
    if hf:  # the pages say `pip install transformers peft`; `make test` installs them aside, which a
        # program finds as the HF tests do (tests/hf_env.py: on the path once Lightning is imported)
        path = f"import lightning\nimport sys\n\nsys.path.append({str(HF_PACKAGES)!r})\n"
        text = f"{path}\n{text}"
    (tmp_path / "program.py").write_text(text)
    # Trainer defaults for what a page leaves out, from Lightning's own PL_TRAINER_* variables (an
    # argument the page gives wins): the CPU, one epoch; a port from this worker's range for a job.
    environ = dict(os.environ, PL_TRAINER_ACCELERATOR="cpu", PL_TRAINER_MAX_EPOCHS="1")
    environ.update(PL_TRAINER_ENABLE_PROGRESS_BAR="False")
    environ.pop("PYTHONUNBUFFERED", None)  # each rank's lines written whole (see _run_page)
    environ.update(MASTER_PORT=str(free_port()))
    try:
        mp.start_processes(_run_page, args=(str(tmp_path), environ), nprocs=1, start_method=START_METHOD)
    except Exception as err:
        printed = (tmp_path / "printed.txt").read_text() if (tmp_path / "printed.txt").exists() else ""
        raise AssertionError(f"{page.name} as pasted fails: {err}\nit printed:\n{printed[-6000:]}") from None
    printed = (tmp_path / "printed.txt").read_text()
    stale = [b for b in quoted_outputs(page) if unprinted(b.code, printed)]
    if stale and os.environ.get("REFRESH_DOCS_OUTPUTS") == "1":
        for block in reversed(stale):  # bottom up: the line numbers above stay true
            page.write_text(refreshed(page.read_text(), block, printed))
        stale = [b for b in quoted_outputs(page) if unprinted(b.code, printed)]
    assert [b.line for b in stale] == [], (
        f"{page.name}: the outputs quoted at lines {[b.line for b in stale]} are not what it prints (rerun "
        f"with REFRESH_DOCS_OUTPUTS=1 to copy them from the output, from each one's first line):\n{printed}"
    )


def test_the_program_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```python\nimport math\nx = math.pi\n```\n\n"
        "<!-- not run: needs 8 GPUs -->\n"
        "```python\nimport os\ntrainer = Trainer(devices=8)\ntrainer.fit(model)\n```\n\n"
        "- an item:\n\n  ```python\n  def f(a):\n      return a + x + y\n  class C:\n      z = trainer\n"
        "  print(os.sep, [k * x for k in range(3)])\n  ```\n\n"
        "<!-- not ran: typo -->\n```python\npass\n```\n\n"
        "```python\nif x\n```\n\n"
        "<!-- output -->\n```text\nline 1\nline 2\n```\n"
    )
    assert undefined_names(page) == [
        "line 9: Trainer, model not defined by this block or an earlier one",
        "line 17: y not defined by this block or an earlier one",  # read in a function: a global
        "line 30: does not compile: expected ':' (its line 1)",
    ]
    assert marker_problems(page) == [
        "line 26: unknown marker <!-- not ran: typo --> before a ```python block"
    ]
    text = program(page, tmp_path)
    assert "# page.md, line 9 (not run: needs 8 GPUs): its imports\nimport os\n\n# page.md, line 17\n" in text
    assert "Trainer(" not in text and "def f(a):\n    return a + x + y\n" in text  # dedented from the item
    [quoted] = quoted_outputs(page)
    assert not unprinted(quoted.code, "a\nline 1  \nline 2\nb") and unprinted(
        quoted.code, "line 1\nb\nline 2"
    )
    assert refreshed(page.read_text(), quoted, "a\nline 1\nline 3\nline 4\n").endswith(
        "line 1\nline 3\n```\n"
    )
    assert refreshed(page.read_text(), quoted, "line 0\nline 2\n") == page.read_text()  # its header gone
