"""Sequence parallelism (Ulysses): design in progress."""
