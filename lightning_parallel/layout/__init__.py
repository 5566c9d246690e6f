"""Where things sit, below everything that uses them: the plan's choice lists (``choices``: schedules,
data-parallel modes, offload targets, partitions, precisions), the rank grid (``ranks``: ``RankLayout``,
the mesh's named dimensions) and this rank's device mesh with its process groups (``mesh``).

One floor below the pipeline's runtime, the techniques and the plan, so each of them reads the same
lists and grid without importing another (``tests/test_layering.py``). Pure PyTorch, no Lightning.
"""
