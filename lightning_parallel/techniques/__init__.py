"""One module per technique, each with the same two entry points.

* ``apply(...)``: put the technique on this rank's stages (or, for a sharded optimizer state, on the
  stages' optimizers), reading its setting from the plan
  (:class:`~lightning_parallel.plan.parallel_plan.ParallelPlan`);
* ``memory(...)``: what the technique does to a stage's memory, composed by the planner
  (:mod:`lightning_parallel.memory`), so what is modelled sits beside what is applied.

The order they are applied in is torchtitan's (:mod:`~lightning_parallel.techniques.parallelize`):
split first, then recomputation, tensor parallelism, a user's ``parallelize_fn``, ``torch.compile``,
and data-parallel sharding (FSDP2) last; a sharded optimizer state (ZeRO-1) wraps the optimizers
once they exist.
"""
