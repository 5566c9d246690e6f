"""The techniques, one module each, and THE ordered list every composer folds.

Each module defines one :class:`~lightning_parallel.techniques.contract.Technique` subclass and one
instance of it: its plan fields' canonical values and refusals, its part of a plan's label, the variants
the planner's search tries, what the job needs before its process group, its transform of this rank's
stages and of the optimizers, a context around each training step and the gradient reductions of the
optimizer step. :data:`TECHNIQUES` applies them top to bottom, in torchtitan's order (split first; then
what changes a stage's computation, then data-parallel sharding, then where the state lives), and
``ParallelPlan``, the search, the set-up and the gradient sync loop over it; the functions below are
those folds that need nothing but the list. A technique never imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_parallel.pipeline.stage_source import UnsplitModel
from lightning_parallel.techniques import causal_attention, overlap, recompute, replicas, user_function, zero
from lightning_parallel.techniques import compile as compiling
from lightning_parallel.techniques.contract import SearchOption, Technique
from lightning_parallel.techniques.fsdp import technique as fsdp
from lightning_parallel.techniques.job import Environment, Job
from lightning_parallel.techniques.offload import technique as offload
from lightning_parallel.techniques.sequence_parallel import technique as sequence_parallel
from lightning_parallel.techniques.tensor_parallel import technique as tensor_parallel

TECHNIQUES: tuple[Technique, ...] = (
    # (before recomputation: a recomputed block then re-enters the sequence-parallel mode it was wrapped in)
    sequence_parallel.TECHNIQUE,  # sequence_parallel_size
    causal_attention.TECHNIQUE,  # (no field: a traced stage's causal mask runs as is_causal=True)
    recompute.TECHNIQUE,  # activation_checkpointing
    tensor_parallel.TECHNIQUE,  # tensor_parallel_size, tensor_parallel_plan
    user_function.TECHNIQUE,  # parallelize_fn
    compiling.TECHNIQUE,  # compile
    fsdp.TECHNIQUE,  # data_parallel="fsdp", data_parallel_shard_size
    zero.TECHNIQUE,  # data_parallel="zero1"
    overlap.TECHNIQUE,  # overlap_gradient_reduction, bucket_cap_mb: the replicas' all-reduce in buckets
    replicas.TECHNIQUE,  # data_parallel="replicate" (and ZeRO-1's replicas): the replicas' all-reduce
    offload.TECHNIQUE,  # offload, offload_pin_memory
)
"""Every technique, in the order they apply (read top to bottom)."""


def environment(plan: Any, device: torch.device) -> Environment:
    """What the job needs before its process group exists, from every technique in turn.

    Raises:
        ValueError: what this device cannot do (a technique's refusal, with the fix).

    Example::

        env = environment(ParallelPlan(offload="parameters", data_parallel="fsdp"), torch.device("cuda", 0))
        env.host_backend, env.parameters_on_host      # (why, in words), True
    """
    env = Environment(device)
    for technique in TECHNIQUES:
        technique.environment(plan, env)
    return env


def before_split(plan: Any, model: UnsplitModel) -> dict[str, Any]:
    """What each technique reads on the unsplit module (every rank calls it, and raises the same
    refusals), by its name: the job's ``before_split``.

    Example::

        read = before_split(plan, source.unsplit(module))   # {"tensor_parallel": TensorPlan(...)}
    """
    return {t.name: found for t in TECHNIQUES if (found := t.before_split(plan, model)) is not None}


def transform_stages(job: Job) -> list[str]:
    """Each technique's transform of this rank's stages, in the list's order (every rank calls it: tensor
    parallelism and FSDP2 are collective over their mesh dimensions); the lines for the log.

    Example::

        for note in transform_stages(job):
            rank_zero_info(f"PipelineStrategy: {note}")
    """
    return [note for technique in TECHNIQUES if (note := technique.stages(job.stages, job))]


class InputTransform:
    """The techniques' transforms of what a step is given: the batch (:meth:`Technique.batch`, by
    calling it) and the keywords of the pipelined call (:meth:`Technique.call_keywords`: ``keywords``,
    None when no technique has one), each in the list's order.

    Example::

        shard = batch_transform(plan, mesh, lightning_module)
        batch = shard(batch) if shard is not None else batch
        kwargs = shard.keywords("model", kwargs) if shard is not None and shard.keywords else kwargs
    """

    def __init__(
        self, batches: list[Callable[[Any], Any]], keywords: list[Callable[[str, dict], dict]]
    ) -> None:
        self.batches, self.keyword_transforms = batches, keywords
        self.keywords = self._keywords if keywords else None

    def __call__(self, batch: Any) -> Any:
        for one in self.batches:
            batch = one(batch)
        return batch

    def _keywords(self, path: str, kwargs: dict) -> dict:
        for one in self.keyword_transforms:
            kwargs = one(path, kwargs)
        return kwargs


def batch_transform(plan: Any, mesh: Any, module: torch.nn.Module) -> InputTransform | None:
    """Every technique's transform of the batch and of the pipelined call's keywords, in the list's
    order (:class:`InputTransform`); None: none.

    Example::

        shard = batch_transform(plan, mesh, lightning_module)
        batch = shard(batch) if shard is not None else batch
    """
    batches = [t for technique in TECHNIQUES if (t := technique.batch(plan, mesh, module)) is not None]
    keywords = [t for tech in TECHNIQUES if (t := tech.call_keywords(plan, mesh, module)) is not None]
    if not batches and not keywords:
        return None
    return InputTransform(batches, keywords)


def item_count(plan: Any, mesh: Any, count: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The user's item count through every technique's :meth:`Technique.item_count`, in the list's order.

    Example::

        count = item_count(plan, mesh, labelled_tokens("labels", shift=True))   # then per micro-batch
    """
    for technique in TECHNIQUES:
        count = technique.item_count(plan, mesh, count)
    return count


def predictions(output: Any, batch: Any, mesh: Any) -> Any:
    """A prediction step's output through every technique's :meth:`Technique.predictions`, in the list's
    order (every rank calls it: a technique's may be a collective of its group).

    Example::

        output = predictions(output, batch, mesh)   # then the replicas' predictions are collected
    """
    for technique in TECHNIQUES:
        output = technique.predictions(output, batch, mesh)
    return output


def searched_fields() -> tuple[str, ...]:
    """The plan fields some technique's variants decide (the planner's search, beside its core).

    Example::

        >>> "offload" in searched_fields()
        True
    """
    return tuple(name for technique in TECHNIQUES for name in technique.searched)


def search_options() -> tuple[SearchOption, ...]:
    """Every technique's search options (``Technique.search_options``), in the list's order: the planner's
    ``Search`` keywords and command-line flags beside its core's.

    Example::

        >>> [option.flag for option in search_options() if option.name == "offload"]
        ['--no-offload']
    """
    return tuple(option for technique in TECHNIQUES for option in technique.search_options)
