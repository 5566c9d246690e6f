"""Will it fit? Per-rank peak memory of a training step under DDP or PipelineStrategy, predicted.

Pure PyTorch (no Lightning import): :func:`estimate_memory` and the ``python -m
lightning_parallel.memory`` command.
"""
