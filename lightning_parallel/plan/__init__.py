"""The ground floor: ONE parallel plan (:class:`~lightning_parallel.plan.parallel_plan.ParallelPlan`).

What ``PipelineStrategy`` runs and what the memory planner sizes and returns: a planner row is a plan a
strategy can run. Every parallelism and technique reads its setting here, and nowhere else.
"""
