"""Which configurations the planner tries: the plans a device count, a model and a batch allow.

A :class:`Search` says what is given (the devices, the global batch, one replica's batch) and which
options to try; :meth:`Search.plans` lists the ``PipelineStrategy`` plans: the core's (every pipeline
size that divides the devices, ``pipeline_size=1`` being pure data parallelism through the strategy;
the searched schedules; micro-batches in {p, 2p, 4p}, or 1, 2, 4 for p = 1), then each technique's
variants on top of them in the list's order (``Technique.variants``: with and without recomputation,
FSDP2 (for a split ``nn.Sequential``), ZeRO-1, each offload), keeping the plans the plan's own checks
accept (what cannot combine is refused there, once). Tensor-parallel sizes are tried one call each
(each is measured on its own local model).

**The global batch.** A replica's dataloader yields one batch per step; a plan with ``d`` replicas sees
``d`` of them, and ``accumulate = global / (batch x d)`` batches make one optimizer step (as
:class:`~lightning_parallel.GradientAccumulationScheduler` computes it at run time). Without a given
``batch_size`` (the command line, planning before any loader exists) each replica's batch is
``global / d`` and nothing accumulates; without a ``global_batch_size`` the global batch is what the
replicas' batches add up to, and plans are compared by time per sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_parallel._options import unknown_option_error
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.techniques import TECHNIQUES, search_options, searched_fields
from lightning_parallel.techniques.contract import SearchOptions

SEARCHED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""The schedules the search tries (the zero-bubble ones are run by hand: their memory is modelled too)."""

CORE_SEARCHED = (
    "pipeline_size",
    "num_microbatches",
    "schedule",
    "stages_per_rank",
    "data_parallel",
    "partition",
)
"""The plan's own fields the search decides (``partition``: left at its default)."""

SEARCHED_FIELDS = CORE_SEARCHED + searched_fields()
"""Every plan field the search decides: the core's and the techniques' (``Technique.searched``)."""


@dataclass(frozen=True, init=False)
class Search:
    """The planner's question: these devices, this batch; these options to try.

    Args:
        devices: ranks in all.
        global_batch_size: samples per optimizer step over every replica (``None``: the replicas'
            batches, whatever their number).
        batch_size: one replica's batch, as its dataloader yields it (``None``: ``global / replicas``).
        precision: the Trainer's precision.
        pipeline_sizes: pipeline sizes to try (default: every divisor of the devices).
        schedules: of :data:`SEARCHED_SCHEDULES`.
        tensor_parallel_sizes: tensor-parallel sizes to try (each measured on its own local model).
        ranks_per_node: ranks sharing one host's memory (default: all of them, one node).
        options: the techniques' search options by name (``Technique.search_options``; those not given:
            their defaults), as ``search.options[name]`` reads them.
        **asked: the same by keyword, e.g. ``offload=False`` (do not try offloading to the host),
            ``offload_parameters=False`` (nor FSDP2's shards), ``offload_dir="/nvme"`` (the optimizer
            state in files under it, the disk tier), ``sequence_parallel=True`` (split the sequence
            wherever the model's heads allow; ``None``, the default: where it is long; ``False``: never).
            Each is its technique's :class:`~lightning_parallel.techniques.contract.SearchOption`, read
            as ``search.offload`` too.

    Raises:
        TypeError: a keyword that is neither the core's nor a technique's search option (the closest
            named).

    Example::

        search = Search(devices=4, global_batch_size=64)
        search.plans(num_blocks=8)           # the plans to size and time
        search.batches(search.plans(8)[0])   # (per-replica batch, batches per optimizer step)
        Search(devices=4, global_batch_size=64, offload=False).options["offload"]     # False
    """

    devices: int
    global_batch_size: int | None = None
    batch_size: int | None = None
    precision: str = "32-true"
    pipeline_sizes: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    ranks_per_node: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __init__(
        self,
        devices: int,
        global_batch_size: int | None = None,
        batch_size: int | None = None,
        precision: str = "32-true",
        pipeline_sizes: tuple[int, ...] | None = None,
        schedules: tuple[str, ...] = SEARCHED_SCHEDULES,
        tensor_parallel_sizes: tuple[int, ...] = (1,),
        ranks_per_node: int | None = None,
        options: Mapping[str, Any] | None = None,
        **asked: Any,
    ) -> None:
        given = locals()
        for name in _CORE_KEYWORDS:
            object.__setattr__(self, name, given[name])
        object.__setattr__(self, "options", _technique_options({**(options or {}), **asked}))
        for name in ("devices", "global_batch_size", "batch_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.global_batch_size is None and self.batch_size is None:
            raise ValueError("give the global batch size, one replica's batch size, or both")

    def __getattr__(self, name: str) -> Any:
        # A technique's search option read as an attribute, as before they were the techniques' own
        # (``search.offload``); only what is not found the ordinary way comes here.
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def node_ranks(self) -> int:
        return min(self.ranks_per_node or self.devices, self.devices)

    def batches(self, plan: ParallelPlan) -> tuple[int, int] | None:
        """``(one replica's batch, batches per optimizer step)`` for ``plan``, or None if the global batch
        cannot be made of whole batches of its replicas."""
        dp = plan.data_parallel_size
        if self.batch_size is None:
            assert self.global_batch_size is not None
            return (self.global_batch_size // dp, 1) if self.global_batch_size % dp == 0 else None
        if self.global_batch_size is None:
            return self.batch_size, 1
        per_step = self.batch_size * dp
        if self.global_batch_size % per_step:
            return None
        return self.batch_size, self.global_batch_size // per_step

    def plans(
        self, num_blocks: int, tensor_parallel_size: int = 1, layout: str = "", model: Any = None
    ) -> list[ParallelPlan]:
        """Every plan to try at one tensor-parallel size whose batches divide as they must.

        ``layout``: how the model's units are laid out (``UnitLayout.kind``); ``model``: the measured
        model (``ModelFacts``), where there is one; the techniques' variants read both
        (:class:`~lightning_parallel.techniques.contract.SearchOptions`).

        Raises:
            ValueError: a requested pipeline size does not divide the devices or exceeds the blocks.
        """
        plans = [
            replace(base, num_microbatches=m, schedule=schedule, stages_per_rank=v)
            for base in self._shapes(num_blocks, tensor_parallel_size)
            if (found := self.batches(base)) is not None
            for schedule, v in _schedules(base.pipeline_size, num_blocks, self.schedules)
            for m in _microbatches(base.pipeline_size, found[0])
        ]  # the core's: pipeline shapes x schedules x micro-batches
        options = SearchOptions(layout, model, self.options)
        for technique in TECHNIQUES:
            plans = _accepted((plan, o) for plan in plans for o in technique.variants(plan, options))
        return [plan for plan in plans if self._splits_plan(plan)]  # (a variant may change the replicas)

    def _splits_plan(self, plan: ParallelPlan) -> bool:
        """Whether ``plan``'s replicas make whole batches of the global batch, each split into its
        micro-batches."""
        found = self.batches(plan)
        return found is not None and found[0] % plan.num_microbatches == 0

    def split_error(self, num_blocks: int) -> str | None:
        """Why no plan of the search splits the global batch over the devices, with the nearest global
        batches that split (None: some plan does). Each pipeline shape says what it lacks.

        Example::

            >>> print(Search(devices=2, global_batch_size=7).split_error(num_blocks=4))
            no plan splits the global batch (7) over 2 devices (pp 1x2: 7 is not a multiple of its 2
            replicas; pp 2x1: 7 per replica cannot make 2, 4 or 8 equal micro-batches): use a global
            batch of e.g. 6 or 8
        """
        if self._splits(num_blocks):
            return None
        why = "; ".join(dict.fromkeys(self._lacks(base) for base in self._bases(num_blocks)))
        near = self._nearest_global_batches(num_blocks)
        fix = (f"use a global batch of e.g. {near[0]} or {near[1]}" if near else
               "use a batch per replica that the micro-batches divide, and a global batch that is a "
               "multiple of it x the replicas")  # fmt: skip
        per = f" and a batch of {self.batch_size} per replica" if self.batch_size is not None else ""
        return (
            f"no plan splits the global batch ({self.global_batch_size}){per} over {self.devices} devices"
            + (f" ({why})" if why else "") + f": {fix}"
        )  # fmt: skip

    def _shapes(self, num_blocks: int, tp: int) -> list[ParallelPlan]:
        """The pipeline shapes (no variants yet) at tensor-parallel size ``tp``."""
        if tp < 1 or self.devices % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the devices ({self.devices})")
        ranks = self.devices // tp
        every = [p for p in range(1, ranks + 1) if ranks % p == 0 and p <= num_blocks]
        sizes = list(self.pipeline_sizes or every)
        if self.pipeline_sizes and tp > 1:
            sizes = [p for p in sizes if ranks % p == 0]  # the others are tried at tp = 1
        for p in sizes:
            if ranks % p or p > num_blocks:
                raise ValueError(
                    f"pipeline size {p} does not fit: it must divide the devices ({self.devices}) and be at "
                    f"most the number of blocks ({num_blocks})"
                )
        return [ParallelPlan("pipeline", self.devices, p, tensor_parallel_size=tp, precision=self.precision)
                for p in sizes]  # fmt: skip

    def _bases(self, num_blocks: int) -> list[ParallelPlan]:
        """The pipeline shapes at every tensor-parallel size of the search."""
        return [base for tp in self.tensor_parallel_sizes for base in self._shapes(num_blocks, tp)]

    def _splits(self, num_blocks: int) -> bool:
        """Whether some shape makes whole batches of its replicas and equal micro-batches of them."""
        for base in self._bases(num_blocks):
            found = self.batches(base)
            if found is not None and _microbatches(base.pipeline_size, found[0]):
                return True
        return False

    def _lacks(self, base: ParallelPlan) -> str:
        """What ``base`` misses: whole batches for its replicas, or equal micro-batches of one."""
        p, dp, tp = base.pipeline_size, base.data_parallel_size, base.tensor_parallel_size
        shape = f"pp {p}x{dp}" + (f" tp={tp}" if tp > 1 else "")
        found = self.batches(base)
        if found is None:
            of = f"its {dp} replicas" if dp > 1 else "1 replica"
            of += f" x {self.batch_size}" if self.batch_size is not None else ""
            return f"{shape}: {self.global_batch_size} is not a multiple of {of}"
        m = (1, 2, 4) if p == 1 else (p, 2 * p, 4 * p)
        return f"{shape}: {found[0]} per replica cannot make {m[0]}, {m[1]} or {m[2]} equal micro-batches"

    def _nearest_global_batches(self, num_blocks: int) -> tuple[int, int] | None:
        """The nearest global batch below the given one that splits and the nearest above (or the two
        nearest above), or None (some pipeline sizes only, none splits the batch)."""
        given = self.global_batch_size or 1
        end = 2 * given + 4 * self.devices * (self.batch_size or 1)  # past two multiples of the replicas

        def splits(g: int) -> bool:
            return replace(self, global_batch_size=g)._splits(num_blocks)

        below = next(([g] for g in range(given - 1, 0, -1) if splits(g)), [])
        above = list(itertools.islice((g for g in range(given + 1, end) if splits(g)), 2 - len(below)))
        found = below + above
        return (found[0], found[1]) if len(found) == 2 else None

    def micro_batch_sizes(self, num_blocks: int) -> tuple[int, int]:
        """The smallest and the largest micro-batch of the search's plans (what the time probe measures).

        Example::

            >>> Search(devices=2, global_batch_size=32).micro_batch_sizes(num_blocks=4)
            (4, 16)
        """
        sizes = []
        for tp in self.tensor_parallel_sizes:
            for plan in self.plans(num_blocks, tp):
                found = self.batches(plan)
                if found is not None:
                    sizes.append(found[0] // plan.num_microbatches)
        if not sizes:
            return (1, 1)
        return min(sizes), max(sizes)


_CORE_KEYWORDS = (
    "devices",
    "global_batch_size",
    "batch_size",
    "precision",
    "pipeline_sizes",
    "schedules",
    "tensor_parallel_sizes",
    "ranks_per_node",
)
"""``Search``'s own keywords (besides ``options``), in its signature's order."""


def _technique_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every technique's search option by name: ``given``'s value, else its default.

    Raises:
        TypeError: a name no technique declares (the closest one named).
    """
    declared = {option.name: option.default for option in search_options()}
    for name in given:
        if name not in declared:
            raise unknown_option_error("Search", name, (*_CORE_KEYWORDS, *declared))
    return {**declared, **given}


def _schedules(p: int, num_blocks: int, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    if p == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in schedules if s in ("gpipe", "1f1b")]
    if "interleaved_1f1b" in schedules and 2 * p <= num_blocks:
        out.append(("interleaved_1f1b", 2))
    return out


def _microbatches(p: int, per_replica: int) -> list[int]:
    wanted = (1, 2, 4) if p == 1 else (p, 2 * p, 4 * p)
    return [m for m in wanted if m <= per_replica and per_replica % m == 0]


def _accepted(tried: Iterable[tuple[ParallelPlan, dict[str, Any]]]) -> list[ParallelPlan]:
    """Each plan with its options, where the plan's checks accept them, once each, in order."""
    out, seen = [], set()
    for plan, options in tried:
        try:
            varied = replace(plan, **options) if options else plan
        except (ValueError, TypeError):  # the plan refuses the combination (with the reason, for a user)
            continue
        key = repr(varied)
        if key not in seen:
            seen.add(key)
            out.append(varied)
    return out
