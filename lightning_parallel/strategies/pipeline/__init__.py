"""PipelineStrategy and its Lightning glue, one module per mechanism it wires (build, step, config,
checkpointing, loss scale, parallelize, recompute and ZeRO, items, stop...)."""
