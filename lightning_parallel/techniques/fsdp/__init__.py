"""FSDP2 inside pipeline stages (``data_parallel="fsdp"``, ``data_parallel_shard_size``): each stage's
parameters sharded over its data-parallel ranks (ZeRO-3), HSDP with a shard size below them.

* ``technique.py`` - the technique (:data:`~lightning_parallel.techniques.fsdp.technique.TECHNIQUE`): its
  settings and refusals, its label and search variant, its transform of the stages, its gradient
  reduction, and its memory and time for the planner;
* ``_internals.py`` - the private FSDP2 state a pipeline drives by hand (the end of backward, with or
  without the reduce-scatter).
"""
