"""Tensor parallelism (Megatron-style) inside the stages: the plan (``plan.py``), carrying it out on a
stage (``apply.py``) and one tensor-parallel rank's model for the planner (``memory.py``). A traced
stage's graph runs on DTensors: that part is the traced source's (``sources/traced/tensor_parallel.py``)."""
