"""The Sequential path's call stand-in: this rank's layers in place of the split ``nn.Sequential``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_parallel.pipeline.proxy import PipelinedCall


class PipelinedSequential(nn.Module):
    """This rank's layers of a split ``nn.Sequential``, keyed by their original child names.

    State-dict keys stay those of the unsplit module (``layers.3.weight``); calling it goes through
    a :class:`PipelinedCall`.

    Example::

        proxy = PipelinedSequential({"2": block2, "3": block3}, name="layers")
        module.layers = proxy            # state_dict keys: layers.2.*, layers.3.*
        with proxy.call.replaying(output):
            loss = module.training_step(batch, 0)   # self.layers(x) returns `output`
    """

    def __init__(self, layers: Mapping[str, nn.Module], name: str = "layers") -> None:
        super().__init__()
        for child_name, layer in layers.items():
            self.add_module(child_name, layer)
        self.call = PipelinedCall(f"the pipelined Sequential `self.{name}`", f"layers {list(layers)}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)
