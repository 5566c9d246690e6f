"""What happens to each stage module after the split, in torchtitan's order: tensor parallelism,
recomputation, a user's ``parallelize_fn``, then data parallelism (FSDP2)."""
