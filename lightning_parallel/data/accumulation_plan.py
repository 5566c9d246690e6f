"""Global-batch arithmetic: accumulation plans, accumulation windows and exact per-batch loss weights.

Pure Python (no Lightning, no process group), so every decision the
:class:`~lightning_parallel.GradientAccumulationScheduler` makes can be computed, printed and tested
without a Trainer.

Vocabulary: a *step* is one optimizer step; a *window* is the run of consecutive batches (of one epoch)
whose gradients one step applies; the *factor* is the nominal number of batches per window (Lightning's
``accumulate_grad_batches``); the *global batch* is the number of samples one step sees over all
data-parallel replicas, ``per-device batch x data-parallel size x factor``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_parallel._table import format_table

__all__ = [
    "AccumulationPhase",
    "AccumulationPlan",
    "ValidChoices",
    "Window",
    "check_equal_across_replicas",
    "epoch_batch_sizes",
    "epoch_windows",
    "factor_for_global_batch",
    "loss_multiplier",
    "nearest_valid_choices",
    "next_window",
    "plan_from_factors",
    "plan_from_global_batch",
    "validate_schedule",
]


def validate_schedule(schedule: int | Mapping[int, int], name: str, key_name: str) -> dict[int, int]:
    """Check a ``{key: positive int}`` schedule (or a bare positive int, meaning ``{0: value}``).

    Args:
        schedule: the user's value.
        name: the argument name, for messages (``"global_batch_size"``).
        key_name: what the keys count, for messages (``"optimizer step"``).

    Returns:
        The schedule as a plain dict in increasing key order.

    Raises:
        TypeError: a key or value is not an int, or the schedule is neither an int nor a mapping.
        ValueError: a value is not positive, a key is negative, the keys are not increasing, or the
            mapping is empty.

    Example::

        >>> validate_schedule({0: 64, 1000: 256}, "global_batch_size", "optimizer step")
        {0: 64, 1000: 256}
    """
    if _is_int(schedule):
        schedule = {0: schedule}
    if not isinstance(schedule, Mapping):
        raise TypeError(f"{name} must be an int or a dict {{{key_name}: int}}, got {type(schedule).__name__}")
    if not schedule:
        raise ValueError(f"{name} is an empty dict: give at least {{0: value}}")
    keys, values = list(schedule), list(schedule.values())
    bad = [x for x in keys + values if not _is_int(x)]
    if bad:
        raise TypeError(
            f"{name} keys ({key_name}) and values must be ints, got {bad[0]!r} in {dict(schedule)}"
        )
    if any(k < 0 for k in keys):
        raise ValueError(f"{name} has a negative {key_name} key in {dict(schedule)}: keys count from 0")
    if any(b <= a for a, b in itertools.pairwise(keys)):
        raise ValueError(
            f"{name} keys must be strictly increasing, got {keys}: "
            f"write them in order, e.g. {sorted(set(keys))}"
        )
    if any(v < 1 for v in values):
        raise ValueError(f"{name} values must be positive, got {values} in {dict(schedule)}")
    return dict(schedule)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ValidChoices:
    """The valid settings nearest to an invalid global batch, for error messages."""

    global_batch_sizes: tuple[int, ...]
    per_device_batch_sizes: tuple[int, ...]

    def describe(self) -> str:
        parts = [f"global_batch_size {' or '.join(map(str, self.global_batch_sizes))}"]
        if self.per_device_batch_sizes:
            sizes = " or ".join(map(str, self.per_device_batch_sizes))
            parts.append(f"a per-device batch size of {sizes}")
        return ", or ".join(parts)


def nearest_valid_choices(global_batch_size: int, per_device: int, data_parallel_size: int) -> ValidChoices:
    """The nearest global batch sizes reachable with this loader, and per-device sizes that reach this one.

    Example::

        >>> nearest_valid_choices(100, 8, 2)  # per-device 10 or 5: 2 x 10 x 5 = 2 x 5 x 10 = 100
        ValidChoices(global_batch_sizes=(96, 112), per_device_batch_sizes=(10, 5))
    """
    step = per_device * data_parallel_size
    below = (global_batch_size // step) * step
    above = below + step if below < global_batch_size else below
    globals_ = tuple(sorted({g for g in (below, above) if g >= step}))
    per_device_sizes: tuple[int, ...] = ()
    if global_batch_size % data_parallel_size == 0:
        per_replica = global_batch_size // data_parallel_size
        divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
        larger = [d for d in divisors if d > per_device][:1]
        smaller = [d for d in divisors if d < per_device][-1:]
        per_device_sizes = tuple(larger + smaller)
    return ValidChoices(globals_, per_device_sizes)


def factor_for_global_batch(global_batch_size: int, per_device: int, data_parallel_size: int) -> int:
    """The accumulation factor that gives exactly ``global_batch_size`` samples per optimizer step.

    Raises:
        ValueError: the global batch is smaller than one step's samples, or not a multiple of them; the
            message gives the nearest valid choices.

    Example::

        >>> factor_for_global_batch(256, 32, 4)
        2
    """
    step = per_device * data_parallel_size
    if global_batch_size % step == 0:
        return global_batch_size // step
    choices = nearest_valid_choices(global_batch_size, per_device, data_parallel_size).describe()
    what = "is smaller than" if global_batch_size < step else "is not a multiple of"
    raise ValueError(
        f"global_batch_size ({global_batch_size}) {what} the samples of one batch on every replica: "
        f"per-device batch size ({per_device}) x data-parallel size ({data_parallel_size}) = {step}. "
        f"Use {choices}"
    )


@dataclass(frozen=True)
class AccumulationPhase:
    """From ``start`` (an optimizer step or an epoch) on, accumulate ``factor`` batches per step."""

    start: int
    factor: int
    global_batch_size: int


@dataclass(frozen=True)
class AccumulationPlan:
    """The accumulation schedule resolved against a loader and a data-parallel size; the same on every rank.

    ``unit`` is ``"step"`` when the phases are keyed by optimizer step (a ``global_batch_size`` ramp) and
    ``"epoch"`` for Lightning's ``{epoch: factor}`` form.

    Example::

        >>> plan = plan_from_global_batch({0: 64, 1000: 256}, per_device=8, data_parallel_size=2)
        >>> plan.factor_at(1500)
        16
        >>> print(plan.format_table())
        from step  global batch  per-device batch  replicas  accumulate
        ---------  ------------  ----------------  --------  ----------
                0            64                 8         2           4
             1000           256                 8         2          16
    """

    per_device_batch_size: int
    data_parallel_size: int
    unit: str
    phases: tuple[AccumulationPhase, ...]

    def phase_at(self, index: int) -> AccumulationPhase:
        """The phase in force at optimizer step (or epoch) ``index``."""
        current = self.phases[0]
        for phase in self.phases:
            if phase.start <= index:
                current = phase
        return current

    def factor_at(self, index: int) -> int:
        return self.phase_at(index).factor

    @property
    def changes_mid_epoch(self) -> bool:
        """Whether a factor change can land inside an epoch (keyed by step, more than one phase)."""
        return self.unit == "step" and len(self.phases) > 1

    def format_table(self) -> str:
        """The plan as a table (printed by rank 0 when training starts)."""
        headers = [f"from {self.unit}", "global batch", "per-device batch", "replicas", "accumulate"]
        rows = [
            [
                str(x)
                for x in (p.start, p.global_batch_size, self.per_device_batch_size, self.data_parallel_size)
            ]
            + [str(p.factor)]
            for p in self.phases
        ]
        return format_table(headers, rows, align=">")

    def __str__(self) -> str:
        return self.format_table()


def plan_from_global_batch(
    global_batch_size: int | Mapping[int, int], per_device: int, data_parallel_size: int
) -> AccumulationPlan:
    """Resolve ``global_batch_size`` (an int, or ``{optimizer step: size}``) into accumulation factors.

    Raises:
        ValueError: a size cannot be reached exactly (the message names it and the nearest choices), or
            the ramp does not start at step 0.

    Example::

        >>> plan_from_global_batch(64, per_device=8, data_parallel_size=2).factor_at(0)
        4
    """
    schedule = validate_schedule(global_batch_size, "global_batch_size", "optimizer step")
    if 0 not in schedule:
        raise ValueError(
            f"global_batch_size ramp {schedule} does not say the size at step 0: "
            f"add a 0 key, e.g. {{0: {next(iter(schedule.values()))}, ...}}"
        )
    phases = []
    for start, size in schedule.items():
        try:
            factor = factor_for_global_batch(size, per_device, data_parallel_size)
        except ValueError as err:
            raise ValueError(f"global_batch_size at step {start}: {err}") from None
        phases.append(AccumulationPhase(start, factor, size))
    return AccumulationPlan(per_device, data_parallel_size, "step", tuple(phases))


def plan_from_factors(
    scheduling: Mapping[int, int], per_device: int, data_parallel_size: int
) -> AccumulationPlan:
    """Lightning's ``{epoch: factor}`` form; as in Lightning, epochs before the first key accumulate 1.

    Example::

        >>> plan_from_factors({0: 8, 4: 4}, per_device=32, data_parallel_size=1).factor_at(5)
        4
    """
    schedule = validate_schedule(scheduling, "scheduling", "epoch")
    if 0 not in schedule:
        schedule = {0: 1, **schedule}
    step = per_device * data_parallel_size
    phases = tuple(AccumulationPhase(e, f, f * step) for e, f in schedule.items())
    return AccumulationPlan(per_device, data_parallel_size, "epoch", phases)


def epoch_batch_sizes(
    num_samples: int, batch_size: int, num_batches: int, drop_last: bool
) -> tuple[int, ...]:
    """The sample count of each of the first ``num_batches`` batches of one rank's epoch.

    Example::

        >>> epoch_batch_sizes(num_samples=37, batch_size=8, num_batches=5, drop_last=False)
        (8, 8, 8, 8, 5)
    """
    sizes = []
    for k in range(num_batches):
        size = min(batch_size, num_samples - k * batch_size)
        if size <= 0 or (drop_last and size < batch_size):
            break
        sizes.append(size)
    return tuple(sizes)


@dataclass(frozen=True)
class Window:
    """Batches ``start .. stop-1`` of an epoch feed one optimizer step; ``samples``: their total on a rank."""

    start: int
    stop: int
    factor: int
    samples: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, batch_idx: object) -> bool:
        return isinstance(batch_idx, int) and self.start <= batch_idx < self.stop


def next_window(start: int, factor: int, batch_sizes: Sequence[int]) -> Window:
    """The window that begins at batch ``start`` with nominal ``factor``; the epoch's last one may be short.

    Example::

        >>> next_window(8, 4, (8,) * 9 + (5,))
        Window(start=8, stop=10, factor=4, samples=13)
    """
    stop = min(start + factor, len(batch_sizes))
    if start >= stop:
        raise ValueError(f"window start {start} is past the epoch's {len(batch_sizes)} batches")
    return Window(start, stop, factor, sum(batch_sizes[start:stop]))


def epoch_windows(
    batch_sizes: Sequence[int], factor_at_step: Callable[[int], int], first_step: int = 0
) -> list[Window]:
    """All windows of one epoch, the factor read at each window's first optimizer step.

    Example::

        >>> [(w.start, w.stop) for w in epoch_windows((8,) * 10, lambda step: 1 if step < 2 else 4)]
        [(0, 1), (1, 2), (2, 6), (6, 10)]
    """
    windows, start, step = [], 0, first_step
    while start < len(batch_sizes):
        windows.append(next_window(start, factor_at_step(step), batch_sizes))
        start, step = windows[-1].stop, step + 1
    return windows


def loss_multiplier(window: Window, batch_samples: int, divisor: int) -> float:
    """What to multiply one batch's mean loss by so that a step applies the window's exact mean.

    Lightning divides each batch's loss by ``divisor`` (``trainer.accumulate_grad_batches``) before
    backward, so the multiplier is ``divisor x n_i / N_window``: the backward losses then sum to
    ``sum n_i*loss_i / N_window``. It is exactly 1 for full batches in a full window.

    Example::

        >>> round(loss_multiplier(Window(8, 10, 4, 13), batch_samples=5, divisor=4), 4)  # 4 x 5 / 13
        1.5385
    """
    if batch_samples * divisor == window.samples:
        return 1.0
    return divisor * batch_samples / window.samples


def check_equal_across_replicas(values: Sequence[Sequence[int]], names: Sequence[str]) -> None:
    """Raise if the replicas' per-epoch layouts differ (a step's mean needs equal sample counts per replica).

    Args:
        values: one row per rank, gathered from every rank, so every rank raises the same error.
        names: what each column is.

    Raises:
        ValueError: two ranks disagree; the message shows each rank's values.
    """
    if any(list(row) != list(values[0]) for row in values):
        table = "; ".join(
            f"rank {r}: " + ", ".join(f"{n}={v}" for n, v in zip(names, row)) for r, row in enumerate(values)
        )
        raise ValueError(
            f"the train dataloader differs between ranks ({table}): exact accumulation needs the same "
            "batch size and number of samples on every replica, as DistributedSampler gives"
        )
