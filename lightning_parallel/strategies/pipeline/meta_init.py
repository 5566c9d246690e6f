"""Built on the meta device: each rank then materialises only its own stage at the split.

With ``Trainer.init_module(empty_init=True)`` or ``configure_model`` the LightningModule is built on the
meta device (no memory); the split keeps this rank's layers and allocates them on its device, so no rank
ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from typing_extensions import override


class MetaInit:
    """A mixin of ``PipelineStrategy``: its ``tensor_init_context`` and ``model_sharded_context``.

    Example: ``with trainer.init_module(empty_init=True): model = GPT()`` builds ``model`` on meta.
    """

    precision_plugin: Any

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if empty_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):
            yield
