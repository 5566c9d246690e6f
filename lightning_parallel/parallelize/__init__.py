"""What happens to each stage module after the split: a user's ``parallelize_fn``, then data parallelism."""
