"""Which frames are the user's code, and the main thread's stack as seen from the watchdog's thread.

User code is everything but torch, Lightning, lightning_parallel and the standard library: the report
points at the innermost such frame. Pure PyTorch (no Lightning import; Lightning is only located).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import traceback
from importlib.util import find_spec
from types import FrameType
from typing import Any

import torch

__all__ = ["is_library_file", "main_thread_stack", "short_path", "user_site"]

_TRACKING_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog_state.py")


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(library package directories, standard-library directories): code that is not the user's."""
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    # find_spec locates a package without importing it: this module stays free of Lightning.
    for name in ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities"):
        spec = find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots += list(spec.submodule_search_locations)
    paths = sysconfig.get_paths()
    stdlib = {paths["stdlib"], paths["platstdlib"], os.path.dirname(threading.__file__)}
    return tuple(os.path.realpath(r) + os.sep for r in roots), tuple(
        os.path.realpath(s) + os.sep for s in stdlib
    )


_ROOTS: tuple[tuple[str, ...], tuple[str, ...]] | None = None


@functools.lru_cache(maxsize=8192)
def is_library_file(filename: str) -> bool:
    """Whether code in ``filename`` is torch, Lightning, lightning_parallel or the standard library.

    Everything else is the user's code (their scripts, modules and third-party packages they call).
    The standard library is not the user's either: a ``contextlib`` or ``multiprocessing`` frame says
    nothing about which line of theirs is involved.

    Example::

        is_library_file(torch.__file__)   # True
        is_library_file("train.py")       # False
    """
    global _ROOTS
    if filename.startswith("<"):  # <string>, <frozen runpy>: interpreter plumbing
        return True
    if _ROOTS is None:
        _ROOTS = _library_roots()
    libraries, stdlib = _ROOTS
    path = os.path.realpath(filename)
    if path.startswith(libraries):
        return True
    return path.startswith(stdlib) and "-packages" + os.sep not in path


def user_site(frame: FrameType | None) -> str | None:
    """``path:line`` of the innermost frame of user code at or above ``frame`` (None if there is none).

    Example::

        user_site(sys._getframe())   # "train.py:42"
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename):
            return f"{short_path(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def short_path(filename: str) -> str:
    """The path relative to the working directory when it lies inside it, else as it is.

    Example::

        short_path(os.path.abspath("train.py"))   # "train.py"
    """
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


def main_thread_stack() -> list[list[Any]]:
    """The main thread's Python stack, outermost first: ``[path, line, function, source, is_user]``.

    Read from another thread (the monitor's), as ``faulthandler`` does. Example::

        [f"{path}:{line}" for path, line, _, _, is_user in main_thread_stack() if is_user]
    """
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    return [
        [short_path(f.filename), f.lineno, f.name, (f.line or "").strip(), not is_library_file(f.filename)]
        for f in traceback.extract_stack(frame)
        if f.filename != _TRACKING_FILE  # the tracking wrappers: our plumbing, not where the rank is
    ]
