"""Where the Hugging Face tests find transformers and litgpt: ``.hf_packages`` (``make test`` installs them).

They are kept off the venv: installed there, transformers is imported by torchmetrics, so by every
process that imports Lightning (every spawned rank of the suite, ~2 s each). Importing this module
appends the folder to ``sys.path`` after Lightning is imported, so torchmetrics has already looked.
"""

import importlib
import os
import sys
from pathlib import Path

import lightning  # noqa: F401  (first: torchmetrics decides at its import whether transformers exists)
import pytest

HF_PACKAGES = Path(__file__).resolve().parents[1] / ".hf_packages"

if HF_PACKAGES.is_dir() and str(HF_PACKAGES) not in sys.path:
    sys.path.append(str(HF_PACKAGES))


def require(name: str):
    """The module ``name``; skipped where it is missing outside CI, an error in CI (make test installs it)."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name}: `make test` installs it into {HF_PACKAGES}")
