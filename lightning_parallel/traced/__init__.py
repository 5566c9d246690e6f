"""The traced stage source: a module's forward exported with dynamic sizes (once, for every rank that
traces it: share.py), cut at its blocks, and the parallelize adapters its stage graphs need (tensor
parallelism on DTensors, one FSDP2 root per stage)."""
