"""``sequence_parallel_size=k`` on the technique contract: the batch sharded, the attention made Ulysses.

What the job does with it (the mechanics are this folder's other modules):

* **plan**: one field; ``k=1`` is off; refused with tensor parallelism (both split the heads; a traced
  tensor-parallel stage runs on DTensors, which the all-to-all does not take), with ``compile`` (the
  rewritten nodes and the function mode under dynamo are unchecked) and outside ``strategy="pipeline"``;
* **before the split**: the head counts the model declares (a Hugging Face ``config``'s
  ``num_attention_heads`` / ``num_key_value_heads``, a module's ``heads`` / ``num_heads`` / ``n_head``)
  checked against ``k``, on every rank alike;
* **each batch** (:meth:`SequenceParallel.batch`, the steps and the first input the sources trace at):
  this rank's contiguous shard of every per-token tensor (:func:`.shards.shard_batch`); a Hugging Face
  model that takes ``position_ids`` is given the shard's (a forward pre-hook on it, so a traced call
  carries them as an input), any other has its position ``arange`` offset;
* **the stages**: a traced stage's SDPA nodes become Ulysses calls (:func:`.graph.rewrite_stage`); a
  stage of the user's modules runs its forwards in a :class:`.eager.SequenceParallelMode`;
* **each step** (its context): after the first, a model in which no stage of the pipeline split an
  attention is refused on every rank (its attention saw one shard only).

The sequence ranks join the gradient, token, metric, log and optimizer-shard groups (``layout/ranks.py``:
``SEQUENCE_ROLES``), so the averaging of gradients and the token-weighted mean are the data-parallel
ones, over ``dp x k`` ranks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.techniques.contract import Job, Technique
from lightning_parallel.techniques.sequence_parallel.eager import SequenceParallelMode, run_forwards_in
from lightning_parallel.techniques.sequence_parallel.graph import rewrite_stage
from lightning_parallel.techniques.sequence_parallel.heads import check_heads
from lightning_parallel.techniques.sequence_parallel.labels import shifts_labels
from lightning_parallel.techniques.sequence_parallel.masks import check_window
from lightning_parallel.techniques.sequence_parallel.positions import shard_position_ids, takes_position_ids
from lightning_parallel.techniques.sequence_parallel.shards import joined_shards, sequence_length, shard_batch

_QUERY_HEADS = ("num_attention_heads", "num_heads", "n_head", "heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "kv_heads")


class SequenceParallel(Technique):
    """Ulysses sequence parallelism: each of ``k`` ranks holds ``1/k`` of every sample's tokens.

    Example::

        PipelineStrategy(sequence_parallel_size=2)                    # 2 devices: one sequence, two halves
        PipelineStrategy(pipeline_size=2, sequence_parallel_size=2)   # 4 devices: 2 stages x 2 halves
    """

    name, fields = "sequence_parallel", ("sequence_parallel_size",)

    def __init__(self) -> None:
        # Each job's check of the attentions found, by its stage view (a fit after another has its own).
        self._found: weakref.WeakKeyDictionary[Any, FoundAttention] = weakref.WeakKeyDictionary()

    def normalized(self, plan: Any) -> dict[str, Any]:
        k = plan.sequence_parallel_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"sequence_parallel_size must be a positive int (the ranks each sequence is split over; 1: "
                f"not split), got {k!r}"
            )
        return {}

    def check(self, plan: Any) -> None:
        k = plan.sequence_parallel_size
        if k == 1:
            return
        if plan.strategy != "pipeline":
            raise ValueError(
                f"sequence_parallel_size={k} needs PipelineStrategy (strategy='pipeline', with "
                f"pipeline_size=1 for no pipeline), not strategy={plan.strategy!r}"
            )
        if plan.tensor_parallel_size > 1:
            raise ValueError(
                f"sequence_parallel_size={k} with tensor_parallel_size={plan.tensor_parallel_size}: both "
                "split the attention heads, and a tensor-parallel stage's attention runs on DTensors, which "
                "the "
                "sequence all-to-all does not take; use one of them"
            )
        if plan.compiled:
            raise ValueError(
                f"sequence_parallel_size={k} with compile: the sequence exchanges are not checked under "
                "torch.compile yet; leave compile off"
            )

    def label(self, plan: Any) -> str:
        k = plan.sequence_parallel_size
        return f" +sp {k}" if k > 1 else ""

    def before_split(self, plan: Any, model: Any) -> Any:
        k = plan.sequence_parallel_size
        if k > 1:
            for what, (query, kv) in declared_heads(model.module).items():
                try:
                    check_heads(k, query, kv)
                except ValueError as err:
                    raise ValueError(f"{err} ({what})") from None
        return None

    def batch(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[Any], Any] | None:
        """Each batch's shard of this rank (the ``k`` ranks of a group read the same batch); a Hugging Face
        model that takes ``position_ids`` is given its shard's from now on."""
        k = plan.sequence_parallel_size
        if k == 1:
            return None
        index = mesh.rank("sequence")
        for target in position_takers(module):
            give_position_ids(target, index)
        windows = [m for m in module.modules() if getattr(getattr(m, "config", None), "sliding_window", None)]
        shifting = next((type(m).__name__ for m in module.modules() if shifts_labels(m)), None)

        def shard(batch: Any) -> Any:
            if shifting is not None:
                refuse_labels_shifted_in_the_loss(batch, shifting)
            length = sequence_length(batch)
            for target in windows:
                check_window(target, length)
            return shard_batch(batch, index, k)

        return shard

    def stages(self, view: Any, job: Job) -> str | None:
        k = job.plan.sequence_parallel_size
        if k == 1:
            return None
        group = job.mesh.group("sequence")
        found = FoundAttention(job.mesh.size("pipeline"), type(job.module).__name__, job.device)
        if view.graphs:
            positions = not position_takers(job.module)  # (given as position_ids, else offset in the graph)

            def rewrite(stage: Any) -> None:
                attention = rewrite_stage(stage.module, group, positions).attention
                found.counts.append(lambda: attention)

            view.each_stage(rewrite)
        else:

            def run_in_mode(stage: Any) -> None:
                mode = SequenceParallelMode(group, tokens=0)
                stage.module.register_forward_pre_hook(_tokens_of(mode))
                run_forwards_in(mode, stage.module)
                found.counts.append(lambda: mode.attention_calls)

            view.each_stage(run_in_mode)
        self._found[job.stages] = found
        return f"sequence parallelism: each sequence split over {k} ranks (Ulysses all-to-all attention)"

    def step_context(self, job: Job) -> contextlib.AbstractContextManager[Any] | None:
        if job.plan.sequence_parallel_size == 1:
            return None
        return self._found[job.stages]  # (a context entered step after step)


def joined_predictions(output: Any, batch: Any, mesh: Any) -> Any:
    """A prediction step's output on every rank of the sequence-parallel group, joined in token order
    (each rank predicted its shard's tokens of ``batch``, the shard it was given); a collective of the
    group, before the replicas' predictions are collected."""
    outputs: list[Any] = [None] * mesh.size("sequence")
    dist.all_gather_object(outputs, output, group=mesh.group("sequence"))
    return joined_shards(outputs, sequence_length(batch))


TECHNIQUE = SequenceParallel()


class FoundAttention:
    """The attentions this rank's stages split; after the first step, a pipeline that split none refused.

    A context around each schedule step (reused: it checks at the first exit without an error).

    A stage may hold none (the head alone): under a pipeline the counts are summed, one all-reduce over
    every rank after the first schedule step (each is there), so every rank raises together.
    """

    def __init__(self, size: int, what: str, device: torch.device) -> None:
        self.size, self.what, self.device = size, what, device
        self.counts: list[Callable[[], int]] = []
        self.checked = False

    def __enter__(self) -> FoundAttention:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self.checked or kind is not None:  # (once; not over another error)
            return
        self.checked = True
        total = float(sum(count() for count in self.counts))
        if self.size > 1:
            # Over the world, not the pipeline: every rank is here after its first schedule step, and
            # every pipeline holds the same model (the sum is the pipelines' count times theirs). An
            # all-reduce on the pipeline's own group here hung on gloo (4 ranks, pp 2 x sp 2), behind
            # the schedule's point-to-point traffic on that group.
            found = torch.tensor([total], device=self.device)
            dist.all_reduce(found)
            total = float(found.item())
        if total == 0:
            raise RuntimeError(
                f"sequence parallelism found no attention to split in {self.what}: it looks for calls of "
                "torch.nn.functional.scaled_dot_product_attention (its aten op in a traced stage), and none "
                "ran, so each rank's attention saw only its own shard of the sequence. A Hugging Face "
                "model: load it with attn_implementation='sdpa'; a model of yours: compute attention with "
                "F.scaled_dot_product_attention(q, k, v, is_causal=True) instead of softmax(q @ k^T)"
            )


def refuse_labels_shifted_in_the_loss(batch: Any, model: str) -> None:
    """A dict batch with ``labels`` and no ``shift_labels``, for a Hugging Face causal LM that shifts its
    ``labels=`` inside its loss: refused (each shard's last position would lose its label, the next
    shard's first token, and the loss would be wrong without an error). Every rank holds the same batch
    and model: they refuse together.

    Example::

        >>> refuse_labels_shifted_in_the_loss({"input_ids": 0, "shift_labels": 0, "labels": 0}, "M")
    """
    if isinstance(batch, dict) and "labels" in batch and "shift_labels" not in batch:
        raise ValueError(
            f"sequence parallelism and {model}, a Hugging Face causal LM that shifts its labels= inside "
            "its loss: on a shard of the sequence that shift would drop each shard's last label (the "
            "next shard's first token), and the loss would be silently wrong. Shift before the split: "
            "give the batch 'shift_labels' as well (labels[:, 1:] followed by -100, made in your "
            "collate function: transformers' loss then uses them as they are), or compute the loss "
            "yourself from the logits against targets shifted in the data"
        )


def _tokens_of(mode: SequenceParallelMode) -> Callable[..., None]:
    """A stage's forward pre-hook: the mode's shard length is its input's (ids or hidden states: dim 1)."""

    def hook(_module: nn.Module, args: tuple) -> None:
        first = next((a for a in args if torch.is_tensor(a) and a.dim() > 1), None)
        if first is not None:
            mode.tokens = first.shape[1]

    return hook


def declared_heads(module: nn.Module) -> dict[str, tuple[int, int]]:
    """The attention head counts ``module``'s submodules declare: ``{path: (query heads, kv heads)}``.

    A Hugging Face model's ``config`` (``num_attention_heads``, ``num_key_value_heads``), else a module's
    own integer attribute (``heads``, ``num_heads``, ``n_head``). Example: ``{"model": (4, 2)}``.
    """
    found: dict[str, tuple[int, int]] = {}
    for path, sub in module.named_modules():
        config = getattr(sub, "config", None)
        holder = config if _int_attr(config, _QUERY_HEADS) is not None else sub
        query = _int_attr(holder, _QUERY_HEADS)
        if query is None or any(p == "" or path.startswith(p + ".") for p in found):
            continue  # (the outermost declaration: a Hugging Face model's config, not its layers')
        kv = _int_attr(holder, _KV_HEADS)
        found[path] = (query, kv if kv is not None else query)
    return {f"{type(module.get_submodule(p)).__name__} at {p or 'the module'!r}": v for p, v in found.items()}


def _int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def position_takers(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``module`` whose forward takes ``position_ids``."""
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if any(path.startswith(p + ".") for p, _ in found) or sub is module:
            continue
        if getattr(sub, "config", None) is not None and takes_position_ids(sub):
            found.append((path, sub))
    return [sub for _, sub in found]


def give_position_ids(target: nn.Module, index: int) -> None:
    """Give each call of ``target`` shard ``index``'s positions (``(b, t)``, one row a sample, so a
    pipeline splits them into micro-batches with the ids) unless it passes some; once per module."""
    hooks = target.__dict__.setdefault("_sequence_parallel_positions", {})
    for handle in hooks.values():
        handle.remove()

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is not None:
            return args, kwargs
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if tokens is None:
            tokens = next((a for a in args if torch.is_tensor(a)), None)
        if tokens is None or tokens.dim() < 2:
            return args, kwargs
        positions = shard_position_ids(tokens, index).expand(tokens.shape[0], -1).contiguous()
        return args, {**kwargs, "position_ids": positions}

    hooks["positions"] = target.register_forward_pre_hook(hook, with_kwargs=True)
