"""PipelineStrategy's checkpoint hooks: what it saves and loads, as one file or a DCP directory.

Lightning calls these on the strategy; the mechanics live in ``consolidated`` (the consolidated
file: gathered on global rank 0 on save, each rank taking its stage's keys on load) and
``distributed_checkpoint`` (``save_distributed_checkpoint=True``: every rank writes and reads its own shards).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from typing_extensions import override

import lightning_parallel.strategies.pipeline.distributed_checkpoint as dcp_glue
from lightning_parallel.optim.home import home_device
from lightning_parallel.strategies.pipeline.consolidated import (
    consolidated_optimizer_state,
    consolidated_state_dict,
    load_stage_optimizer_states,
    load_stage_state,
)


class PipelineCheckpointHooks:
    """The state-dict and checkpoint hooks of :class:`~lightning_parallel.PipelineStrategy` (a mixin).

    It reads the strategy's ``parallel_plan``, ``parts``, ``lightning_module``, ``optimizers`` and
    ``root_device``; the other hooks of Lightning's ``Strategy`` come after it in the bases.

    Example::

        class PipelineStrategy(PipelineCheckpointHooks, DDPStrategy): ...
        strategy.lightning_module_state_dict()    # the unsplit module's state on global rank 0
    """

    parallel_plan: Any
    parts: Any

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit module's state dict on global rank 0 (replica 0's stages send theirs there).

        With ``save_distributed_checkpoint=True``: this rank's stage state, not gathered."""
        if self.parallel_plan.save_distributed_checkpoint:
            return self.lightning_module.state_dict()
        return consolidated_state_dict(self.lightning_module, self.parts)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The unsplit model's optimizer state on global rank 0, keyed as a single-device one.

        With ``save_distributed_checkpoint=True``: this rank's share, flat and keyed by parameter name."""
        if self.parallel_plan.save_distributed_checkpoint:
            return dcp_glue.local_optimizer_state(optimizer, self.parts)
        return consolidated_optimizer_state(getattr(optimizer, "_optimizer", optimizer), self.parts)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after the split: each rank takes only its stage's keys, and a model built on the
        # meta device is materialised before the weights arrive.
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self.parallel_plan.save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("storage_options is not supported with save_distributed_checkpoint=True")
        dcp_glue.save_checkpoint_dir(self.parts, checkpoint, str(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if os.path.isdir(checkpoint_path):  # a distributed checkpoint: the states are read by the hooks below
            return dcp_glue.load_checkpoint_meta(str(checkpoint_path), weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if dcp_glue.is_directory_checkpoint(checkpoint):
            return dcp_glue.load_model(self.lightning_module, checkpoint, strict)
        load_stage_state(self.lightning_module, self.parts, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if dcp_glue.is_directory_checkpoint(checkpoint):
            dcp_glue.load_optimizers(self.optimizers, self.parts, checkpoint)
        else:
            load_stage_optimizer_states(self.optimizers, self.parts, checkpoint["optimizer_states"])
        # Each optimizer's state where the optimizer keeps it: the device, or the host (offloaded: FSDP2's
        # shards, or host-stepping; it loaded there).
        for optimizer in self.optimizers:
            if home_device(optimizer, self.root_device) == self.root_device:
                _optimizers_to_device([optimizer], self.root_device)
