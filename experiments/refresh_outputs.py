"""Rerun the commands whose output the docs quote, and paste what they print in place of each quote.

A quoted output is a fenced block marked ``<!-- output of the command above -->`` on the line before
its fence; its command is the ```bash block above it (one command; ``\\`` continues a line). Each is run
from the repository root, ``python`` as this interpreter, and the quote's lines are replaced by what it
printed (stdout), nothing else in the page. A command that fails stops the script with its output, and
its page is left as it was. (The pages' Python and the outputs it prints are checked and refreshed by
``tests/test_docs.py``; the demo's run by ``train_charlm.py --refresh-docs``; docs/results.md by
``run_all.py``.)

    python experiments/refresh_outputs.py                   # every page
    python experiments/refresh_outputs.py docs/planner.md   # one page
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- output of the command above -->"


def quotes(lines: list[str]) -> list[tuple[list[str], int, int]]:
    """(the command's words, first and last line of the quote's body) for each marked quote."""
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        start = i + 2  # the fence, then the body
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        close = max(j for j in range(i) if lines[j].startswith("```") and j < i)
        opening = max(j for j in range(close) if lines[j].startswith("```bash"))
        command = " ".join(line.rstrip("\\").strip() for line in lines[opening + 1 : close])
        found.append((shlex.split(command), start, end))
    return found


def run(words: list[str], root: Path) -> list[str]:
    """What the command prints, ``python`` being this interpreter (one thread, the repository's package)."""
    words = [sys.executable if w == "python" else w for w in words]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.run(words, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(words)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout.rstrip("\n").splitlines()


def refresh(page: Path, root: Path = ROOT) -> int:
    """Rerun ``page``'s quoted commands and paste their output; how many quotes it rewrote."""
    lines = page.read_text().splitlines()
    found = quotes(lines)
    for words, start, end in reversed(found):  # bottom up: the line numbers above stay true
        lines[start:end] = run(words, root)
    page.write_text("\n".join(lines) + "\n")
    return len(found)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pages", nargs="*", type=Path, help="pages to refresh (default: README.md and docs/*.md)")
    args = p.parse_args(argv)
    for page in args.pages or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if MARKER in page.read_text():
            print(f"{page}: {refresh(page)} output(s) pasted from a fresh run")


if __name__ == "__main__":
    main()
