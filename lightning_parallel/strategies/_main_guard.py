"""Refuse a spawn launch, in the main process, when every worker would run the launch again.

``spawn`` and ``forkserver`` workers start by running the main script again from the top; a script
that builds and fits its Trainer outside ``if __name__ == "__main__":`` makes each worker launch again.
Lightning notices that inside the worker, which then dies; but CPython's spawn keeps the worker's end
of its start-up pipe open in the main process while it writes the pickled Trainer into it, so when
that pickle is larger than the pipe (64 KiB: a LightningCLI, a vocabulary held by the module) and the
worker dies before reading it, the main process waits forever. Checking the script before any worker
starts turns that hang into the error, at once, with the line to move.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
from types import FrameType


def refuse_unguarded_launch(start_method: str) -> None:
    """Raise if the main script reaches this launch outside ``if __name__ == "__main__":``.

    Raises:
        RuntimeError: naming the script's line, and the two ways out.
    """
    found = unguarded_launch_line()
    if found is None:
        return
    path, line, text = found
    raise RuntimeError(
        f'start_method="{start_method}" starts every worker by running {path} again from the top, and line '
        f"{line} (`{text}`) would launch training again in each of them: it runs outside an "
        f'`if __name__ == "__main__":` block. Put the code that builds and fits the Trainer under it:\n\n'
        f"    def main():\n        ...\n\n"
        f'    if __name__ == "__main__":\n        main()\n\n'
        f'or keep the default start_method="popen", which runs the script itself once per rank'
    )


def unguarded_launch_line() -> tuple[str, int, str] | None:
    """Where the main script, at its top level, reaches the current call unguarded: (file, line, text).

    None when there is no main script file (a notebook, ``python -c``, a REPL), when the call does not
    come from the main script's top level (a thread), or when it is under the guard.
    """
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    frame = _main_script_frame(inspect.currentframe())
    if not path or frame is None or frame.f_code.co_filename != path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return None
    line = frame.f_lineno
    if not runs_unguarded(source, line):
        return None
    return path, line, linecache.getline(path, line).strip()


def runs_unguarded(source: str, line: int) -> bool:
    """Whether the top-level statement holding ``line`` is outside every ``if`` that tests ``__name__``.

    Example::

        runs_unguarded("trainer.fit(model)\\n", 1)                                  # True
        runs_unguarded('if __name__ == "__main__":\\n    trainer.fit(model)\\n', 2)  # False
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return not any(
                isinstance(node, ast.If)
                and node.lineno <= line <= (node.end_lineno or node.lineno)
                and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
                for node in ast.walk(statement)
            )
    return False


def _main_script_frame(frame: FrameType | None) -> FrameType | None:
    """The frame running the main script's top level, if the current call comes from there."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None
