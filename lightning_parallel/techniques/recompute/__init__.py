"""Activation checkpointing of a stage's units (``activation_checkpointing=``): each selected unit's
forward recomputed in backward.

* ``technique.py`` - the technique (:data:`~lightning_parallel.techniques.recompute.technique.TECHNIQUE`):
  its setting checked, its label and search variant, the transform of a rank's stages, what a stage
  keeps per micro-batch and the forwards run again, for the planner;
* ``timing.py`` - checkpointing timed in place on the job (``plan="auto"``), for the planner's time model.

The names the rest of the package and users import live here as before the split.
"""

from lightning_parallel.techniques.recompute.technique import (
    TECHNIQUE,
    Recompute,
    Selection,
    Units,
    apply,
    apply_activation_checkpointing,
    check_selection,
    is_checkpointed,
    local_selection,
    memory,
    recomputed_units,
    remove_activation_checkpointing,
    select_units,
    selected,
)

__all__ = [
    "TECHNIQUE",
    "Recompute",
    "Selection",
    "Units",
    "apply",
    "apply_activation_checkpointing",
    "check_selection",
    "is_checkpointed",
    "local_selection",
    "memory",
    "recomputed_units",
    "remove_activation_checkpointing",
    "select_units",
    "selected",
]
