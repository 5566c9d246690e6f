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
  attention is refused on every rank (its attention saw one shard only);
* **the planner** (``planned.py``, the model in its docstring): each rank's per-token bytes ``/ k`` and
  the exchanges' buffers; its compute at ``1/k`` of the tokens and four all-to-alls per attention and
  micro-batch each way; the search tries ``k`` where the model declares heads it splits.

The sequence ranks join the gradient, token, metric, log and optimizer-shard groups (``layout/ranks.py``:
``SEQUENCE_ROLES``), so the averaging of gradients and the token-weighted mean are the data-parallel
ones, over ``dp x k`` ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.grads.item_weights import LabelledTokens
from lightning_parallel.techniques.contract import (
    CostLedger,
    Job,
    MemoryLedger,
    SearchOptions,
    Technique,
    TimeLedger,
)
from lightning_parallel.techniques.sequence_parallel import planned
from lightning_parallel.techniques.sequence_parallel.eager import SequenceParallelMode, run_forwards_in
from lightning_parallel.techniques.sequence_parallel.graph import rewrite_stage
from lightning_parallel.techniques.sequence_parallel.heads import check_heads
from lightning_parallel.techniques.sequence_parallel.labels import (
    IGNORE_INDEX,
    ShardLabelledTokens,
    shift_across_shards,
    shifts_labels,
    with_shift_labels,
)
from lightning_parallel.techniques.sequence_parallel.masks import check_window
from lightning_parallel.techniques.sequence_parallel.model_checks import (
    FoundAttention,
    declared_heads,
    shifting_inside,
    warn_labels_to_a_holder,
)
from lightning_parallel.techniques.sequence_parallel.positions import shard_position_ids, takes_position_ids
from lightning_parallel.techniques.sequence_parallel.shards import joined_shards, sequence_length, shard_batch


class SequenceParallel(Technique):
    """Ulysses sequence parallelism: each of ``k`` ranks holds ``1/k`` of every sample's tokens.

    Example::

        PipelineStrategy(sequence_parallel_size=2)                    # 2 devices: one sequence, two halves
        PipelineStrategy(pipeline_size=2, sequence_parallel_size=2)   # 4 devices: 2 stages x 2 halves
    """

    # (searched: plan="auto" chooses k, as the search tries it, and refuses one given beside it)
    name, fields, searched = "sequence_parallel", ("sequence_parallel_size",), ("sequence_parallel_size",)
    search_options = (planned.SPLIT_SEQUENCES,)

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

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        """``k`` among the sizes that split every attention's heads (the model's, as the search measured
        it: ``search.model``) and divide the ranks a pipeline rank's replicas share and the sequence;
        where the sequence is long (:data:`planned.LONG_SEQUENCE` tokens) or the search asks for it. Each
        with the plan's micro-batches, and with ``k`` times as many: ``k`` replicas become one, whose
        batch is ``k`` times theirs, so its micro-batches are theirs (the search keeps the plans whose
        batches split into their micro-batches)."""
        yield {}
        facts, wanted = search.model, search.asks(planned.SPLIT_SEQUENCES)
        if facts is None or wanted is False or plan.sequence_parallel_size != 1 or plan.devices is None:
            return
        tokens = getattr(facts, "tokens", 0)
        if wanted is None and tokens < planned.LONG_SEQUENCE:
            return  # (short)
        ranks = plan.devices // (plan.pipeline_size * plan.tensor_parallel_size)
        for k in planned.sizes(facts.layout):
            if ranks % k == 0 and planned.tokens_split(tokens, k):
                yield {"sequence_parallel_size": k}
                yield {"sequence_parallel_size": k, "num_microbatches": plan.num_microbatches * k}

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
                batch = with_shift_labels(batch)  # (before the split: every shard's labels its own)
            length = sequence_length(batch)
            for target in windows:
                check_window(target, length)
            return shard_batch(batch, index, k)

        return shard

    def call_keywords(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[str, dict], dict] | None:
        """A Hugging Face causal LM called with ``labels=`` and no ``shift_labels``: given its shard's
        next-token labels (:func:`~.labels.shift_across_shards`: the next shard's first label, one
        all-gather of the group), which its loss then uses instead of shifting the shard's own, and
        which the strategy's item count reads (each shard's mean weighted by its labelled tokens)."""
        if plan.sequence_parallel_size == 1:
            return None
        shifting = {path: type(sub).__name__ for path, sub in module.named_modules() if shifts_labels(sub)}
        if not shifting:
            return None
        group = mesh.group("sequence")
        warned: list[str] = []

        def shift(path: str, kwargs: dict) -> dict:
            labels = kwargs.get("labels")
            if not torch.is_tensor(labels) or kwargs.get("shift_labels") is not None:
                return kwargs
            if path not in shifting:
                if not warned:
                    warned.extend(shifting_inside(path, shifting))
                    warn_labels_to_a_holder(path, warned)
                return kwargs
            ignore = kwargs.get("ignore_index", IGNORE_INDEX)
            return {**kwargs, "shift_labels": shift_across_shards(labels, group, ignore)}

        return shift

    def item_count(self, plan: Any, mesh: Any, count: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``labelled_tokens(..., shift=True)`` counts each shard's next-token labels across the shard
        boundary (:class:`~.labels.ShardLabelledTokens`), as the shard's loss averages them; any other
        count sees the shard's micro-batches as they are."""
        if plan.sequence_parallel_size == 1 or not (isinstance(count, LabelledTokens) and count.shift):
            return count
        return ShardLabelledTokens(count, mesh.group("sequence"))

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

    # --- the planner (the model: planned.py's docstring)
    def stage_costs(self, ledger: CostLedger) -> None:
        """Each stage's transients on the whole sequence gain the exchange buffers of its largest
        attention (a send and a receive copy of the query), which :meth:`memory` divides with the rest."""
        if ledger.plan.sequence_parallel_size == 1:
            return
        stages = []
        for c in ledger.stages:
            more = planned.exchange_bytes(ledger.facts, c.units, ledger.micro_batch)
            stages.append(dataclasses.replace(c, forward_transient=c.forward_transient + more,
                                              backward_transient=c.backward_transient + more))  # fmt: skip
        ledger.stages = stages

    def memory(self, ledger: MemoryLedger) -> None:
        """One rank's share of every per-token byte: what each micro-batch keeps, its transients and the
        receive buffers ``/ k`` (after every technique's ``stage_costs``); the parameters, gradients and
        optimizer state as they are (FSDP2's and ZeRO-1's shards count the sequence ranks themselves)."""
        k = ledger.plan.sequence_parallel_size
        if k == 1:
            return
        whole = sum(c.recv_buffers for c in ledger.stages)
        ledger.stages = [planned.shard(c, k) for c in ledger.stages]
        ledger.device["buffers"] -= whole - sum(c.recv_buffers for c in ledger.stages)
        if not planned.unit_attentions(ledger.facts.layout):
            ledger.notes.append(
                f"sequence_parallel_size={k}: no attention module found in the model's units (a class "
                "named ...Attention, or a module with heads/num_heads/n_head): its exchanges are not "
                "charged"
            )

    def time(self, ledger: TimeLedger) -> None:
        """Each stage's units at ``1/k`` of the micro-batch's tokens (their measured lines at ``b/k``
        samples of the whole sequence; what runs before them ``/ k``), plus four all-to-alls per attention
        in forward and four in backward (four more where its unit is recomputed), charged as
        communication; the rank's micro-batch is ``b/k`` samples from then on (its sends, the forwards
        recomputed) and its stages' per-token bytes ``/ k`` (offloaded activations' copies)."""
        plan, facts, links = ledger.plan, ledger.facts, ledger.links
        k, mb = plan.sequence_parallel_size, ledger.micro_batch
        if k == 1:
            return
        mine, again = mb / k, planned.recomputed(facts.layout, plan.activation_checkpointing)
        for c in ledger.stages:
            lines = [ledger.times.unit(n) for n in c.units]
            for share, total in (("forward", ledger.forward), ("backward", ledger.backward)):
                whole = sum(getattr(t, share).at(mb) for t in lines)
                total[c.index] = (total[c.index] - whole) / k + sum(getattr(t, share).at(mine) for t in lines)
            exchanges = {n: planned.all_to_alls(facts, links, n, k, mb) for n in c.units}
            forward = sum(exchanges.values())
            backward = forward + sum(s for n, s in exchanges.items() if n in again)
            ledger.forward[c.index] += forward
            ledger.backward[c.index] += backward
            ledger.share(c.index, "communication", forward + backward)
        ledger.micro_batch = mine
        ledger.stages = [planned.shard(c, k) for c in ledger.stages]

    def predictions(self, output: Any, batch: Any, mesh: Any) -> Any:
        """Each rank predicted its shard's tokens: the shards' outputs joined in token order."""
        return joined_predictions(output, batch, mesh) if mesh.size("sequence") > 1 else output


def joined_predictions(output: Any, batch: Any, mesh: Any) -> Any:
    """A prediction step's output on every rank of the sequence-parallel group, joined in token order
    (each rank predicted its shard's tokens of ``batch``, the shard it was given); a collective of the
    group, before the replicas' predictions are collected."""
    outputs: list[Any] = [None] * mesh.size("sequence")
    dist.all_gather_object(outputs, output, group=mesh.group("sequence"))
    return joined_shards(outputs, sequence_length(batch))


TECHNIQUE = SequenceParallel()


def _tokens_of(mode: SequenceParallelMode) -> Callable[..., None]:
    """A stage's forward pre-hook: the mode's shard length is its input's (ids or hidden states: dim 1)."""

    def hook(_module: nn.Module, args: tuple) -> None:
        first = next((a for a in args if torch.is_tensor(a) and a.dim() > 1), None)
        if first is not None:
            mode.tokens = first.shape[1]

    return hook


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
