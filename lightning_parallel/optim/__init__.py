"""Optimizers as the techniques build them, one floor below the techniques: ``sharded`` (an optimizer's
state sharded over the replicas of a stage, torch's ``ZeroRedundancyOptimizer``), ``home`` (the device an
optimizer keeps its state on, as it says). Pure PyTorch."""
