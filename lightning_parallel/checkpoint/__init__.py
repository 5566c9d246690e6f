"""Checkpoints of sharded runs: torch.distributed.checkpoint directories, written atomically."""
