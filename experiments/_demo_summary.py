"""The main job's closing summary: the lines ``train_charlm.py`` prints, and their quotes in the docs.

README.md quotes the summary's numbers and docs/demo.md the whole output (without its file paths), each
between ``<!-- demo:start -->`` and ``<!-- demo:end -->``; ``train_charlm.py --refresh-docs .`` rewrites
both from its run (nothing else in the pages), as ``run_all.py`` rewrites the results block, so the
quoted numbers are a real run's, with when and where it ran.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SAMPLE_PROMPT = b"    def __init__(self"  # a method's first line: the model continues in code
DOCS_START, DOCS_END = "<!-- demo:start -->", "<!-- demo:end -->"
README_LINES = ("=== run summary ===", "strategy", "optimizer steps", "final val loss", "samples per second")
PATH_LINES = ("CSV log", "checkpoint ", "summary (JSON)")


def summary_lines(summary: dict[str, Any], path: Path | str) -> list[str]:
    """The closing summary, as printed (and quoted in the docs: :func:`refresh_docs`)."""
    lines = [
        "=== run summary ===",
        f"strategy            {summary['strategy']} on {summary['processes']} process(es), "
        f"{summary['data_parallel']} data-parallel replica(s)",
        f"optimizer steps     {summary['optimizer_steps']} x {summary['global_batch_size']} samples",
        f"final train loss    {summary['train_loss']:.4f}",
        f"final val loss      {summary['val_loss']:.4f} nats/byte = {summary['val_bits_per_byte']:.2f} "
        f"bits/byte (the bytes' unigram entropy: {summary['unigram_bits_per_byte']:.2f} bits/byte)",
        f"samples per second  {summary['samples_per_s']:.1f}",
        f"CSV log             {summary['log_csv']}",
        f"checkpoint          {summary['checkpoint']}",
        f"summary (JSON)      {path}",
    ]
    if summary.get("sample"):
        lines += [
            "",
            f"=== a sample from the trained model (prompt {SAMPLE_PROMPT!r}) ===",
            summary["sample"],
        ]
    return lines


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def quoted_summary(summary: dict[str, Any], whole: bool) -> str:
    """What the docs quote of a run: when and where it ran, then its summary (README: the numbers)."""
    lines = summary_lines(summary, "")
    if whole:
        first = next(i for i, line in enumerate(lines) if line.startswith(PATH_LINES))
        lines = [*lines[:first], "[CSV log, checkpoint and summary paths]", *lines[first + len(PATH_LINES) :]]
    else:
        lines = [line for line in lines if line.startswith(README_LINES)]
    when = (
        f"What it printed last on this project's machine ({os.cpu_count()} CPU cores, load average "
        f"{summary['load_avg_1min']:.1f} when it started; training {duration(summary['fit_seconds'])}, "
        f"{duration(summary['wall_s'])} in all)"
    )
    return f"{when}{':' if whole else ', shortened:'}\n\n```text\n" + "\n".join(lines) + "\n```"


def refresh_docs(root: Path, summary: dict[str, Any]) -> None:
    """Rewrite the run's quotes in ``root``'s README.md and docs/demo.md (between the markers)."""
    for page, whole in ((root / "README.md", False), (root / "docs" / "demo.md", True)):
        text = page.read_text()
        if text.count(DOCS_START) != 1 or text.count(DOCS_END) != 1:
            raise SystemExit(f"{page}: needs one {DOCS_START} and one {DOCS_END} around the quoted run")
        head, rest = text.split(DOCS_START)
        tail = rest.split(DOCS_END)[1]
        page.write_text(f"{head}{DOCS_START}\n{quoted_summary(summary, whole)}\n{DOCS_END}{tail}")
