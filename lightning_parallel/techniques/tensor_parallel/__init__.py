"""Tensor parallelism (Megatron-style) inside the stages: the plan (``plan.py``), carrying it out on a
stage module (``apply.py``) or on a traced stage's graph, which then runs on DTensors (``traced.py``), the
technique (``technique.py``) and one tensor-parallel rank's model for the planner (``memory.py``)."""
