"""Lightning callbacks: exact gradient accumulation, all-reduced metrics, crash-safe checkpoints."""
