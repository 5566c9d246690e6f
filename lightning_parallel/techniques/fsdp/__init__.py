"""FSDP2 inside pipeline stages (``data_parallel="fsdp"``, ``data_parallel_shard_size``): each stage's
parameters sharded over its data-parallel ranks (ZeRO-3), HSDP with a shard size below them.

* ``technique.py`` - the technique (:data:`~lightning_parallel.techniques.fsdp.technique.TECHNIQUE`): its
  settings and refusals, its label and search variant, and each member the composers fold;
* ``sharding.py`` - the mechanics: a stage module's blocks and root sharded, the reduce-scatter deferred
  to once per optimizer step;
* ``traced.py`` - a traced stage's one FSDP2 root, which runs the current export graph;
* ``memory.py`` - a rank's shard of the bytes and the stage gathered, for the planner;
* ``timing.py`` - FSDP2 timed in place on the job (``plan="auto"``), for the planner's time model;
* ``_internals.py`` - the private FSDP2 state a pipeline drives by hand (the end of backward, with or
  without the reduce-scatter).
"""
