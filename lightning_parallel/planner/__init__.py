"""Will it fit, and which plan is fastest? The planner: per-rank peak memory and step time, predicted.

Pure PyTorch (no Lightning import): :func:`estimate_memory` (each rank's device peak and host bytes for
one plan), the search and its ranking (:mod:`~lightning_parallel.planner.ranking`, from the memory and
time models of one measurement of the model), and the ``python -m lightning_parallel.planner`` command.
``PipelineStrategy(plan="auto")`` runs its choice.
"""
