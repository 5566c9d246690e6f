"""One step's batch size and micro-batches: computed once, here, and handed to whoever needs them.

The schedule splits its inputs with torch's ``split_args_kwargs_into_chunks`` (``tensor_split`` along
dim 0); the loss weights, the item counts and the example a new shape's stages are built from must
see exactly the micro-batches the schedule will feed, so they are split here with the same function
and the same count, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from lightning_parallel.data.batch_samples import samples_in


def batch_size(batch: Any) -> int:
    """The size of dim 0 of the first batched tensor in ``batch``.

    Raises:
        TypeError: ``batch`` holds no tensor with a dimension.
    """
    n = samples_in(batch)
    if n is None:
        raise TypeError(
            f"PipelineStrategy could not find a batched tensor in the batch ({type(batch).__name__})"
        )
    return n


def microbatch_count(batch_size: int, num_microbatches: int) -> int:
    """The micro-batch count for a batch: the largest divisor of its size up to ``num_microbatches``.

    Equal micro-batches keep the schedule's buffers valid; the loss weighting keeps the mean exact.

    Example::

        >>> microbatch_count(32, 4), microbatch_count(6, 4), microbatch_count(3, 8)
        (4, 3, 3)
    """
    if batch_size < 1:
        raise ValueError("PipelineStrategy received an empty batch")
    m = min(num_microbatches, batch_size)
    while batch_size % m:
        m -= 1
    return m


def split_microbatches(args: tuple[Any, ...], count: int) -> list[tuple[Any, ...]]:
    """``args`` cut into ``count`` micro-batches along dim 0, exactly as the schedule cuts its inputs."""
    chunks, _ = split_args_kwargs_into_chunks(tuple(args), None, count)
    return [tuple(chunk) for chunk in chunks]


def first_microbatch(args: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    """The first micro-batch of ``args``, as the schedule will split them (tensors along dim 0)."""
    return split_microbatches(args, count)[0]


@dataclass
class StepMicrobatches:
    """A step's batch and its micro-batches: the count decided once, each split made once on demand.

    Example::

        mb = StepMicrobatches.of(batch, num_microbatches=4)     # a batch of 6 samples: 3 micro-batches
        mb.size, mb.count, mb.sizes                              # 6, 3, [2, 2, 2]
        mb.batch_chunks()[0]                                     # the first micro-batch of the batch
    """

    batch: Any
    size: int
    count: int
    _batch_chunks: list[Any] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, batch: Any, num_microbatches: int) -> StepMicrobatches:
        size = batch_size(batch)
        return cls(batch, size, microbatch_count(size, num_microbatches))

    def batch_chunks(self) -> list[Any]:
        """The batch's micro-batches (what the step's loss runs on, one at a time)."""
        if self._batch_chunks is None:
            self._batch_chunks = [chunk[0] for chunk in split_microbatches((self.batch,), self.count)]
        return self._batch_chunks

    @property
    def sizes(self) -> list[int]:
        """Samples per micro-batch."""
        return [batch_size(chunk) for chunk in self.batch_chunks()]


def check_feeds(batch: Any, num_microbatches: int) -> None:
    """Raise a ValueError with the fix unless a training batch of ``batch``'s size feeds the micro-batches.

    Example::

        check_feeds(batch, 4)   # a batch of 2 samples: ValueError, with the fix
    """
    n = batch_size(batch)
    if n < num_microbatches:
        raise ValueError(
            f"a training batch of {n} samples cannot feed num_microbatches={num_microbatches}: use a "
            f"per-replica batch size of at least {num_microbatches} (ideally a multiple of it), or fewer "
            f"micro-batches"
        )
