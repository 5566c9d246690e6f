"""What the planner measures once per model and batch: units, parameters, optimizer state, activations."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.planner.optimizer import StateSize, optimizers_from, state_sizes
from lightning_parallel.planner.precision import PRECISION_DTYPES
from lightning_parallel.planner.probe import (
    BEFORE,
    Probe,
    StepFn,
    default_step,
    probe_activations,
    probe_sizes,
)
from lightning_parallel.planner.time_probe import TimeFacts, measure_times
from lightning_parallel.planner.units import UnitLayout, find_units, order_extras
from lightning_parallel.sources.sequential.split import find_sequential
from lightning_parallel.techniques.tensor_parallel.memory import local_model, row_splits
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan, default_plan, traced_plan


@dataclass(frozen=True)
class Tensor:
    """One parameter as the planner sees it: bytes, gradient bytes, optimizer state and group."""

    key: int
    numel: int
    nbytes: int
    grad: int
    state: StateSize | None
    group: int  # optimizer param group (ZeRO shards group by group); -1: not optimized
    rows: int = 1  # size of dim 0, the dimension FSDP2 shards


@dataclass
class ModelFacts:
    """What :func:`measure_model` found; :func:`~lightning_parallel.planner.estimate.predict` sizes configs.

    Example::

        facts = measure_model(model, batch, precision="bf16-mixed")
        predict(facts, ParallelPlan("pipeline", devices=4, pipeline_size=4, num_microbatches=8))
    """

    layout: UnitLayout
    probe: Probe
    samples: int
    precision: str
    tensors: dict[int, Tensor]  # by id of the parameter
    unit_params: dict[str, list[int]]  # unit name -> parameter keys (a tied weight under each unit using it)
    loose_params: list[int]
    group_order: list[list[int]]  # per optimizer param group: parameter keys in group order
    tensor_parallel_size: int = (
        1  # measured on one tensor-parallel rank's local model (memory.tensor_parallel)
    )
    times: TimeFacts | None = None  # each unit's forward and backward seconds (the time model's)
    tp_reduces: dict[str, int] = field(default_factory=dict)  # unit -> all-reduces per pass under tp
    tokens: int = 0  # the batch's sequence length (dim 1 of its first tensor of 2 dims or more; 0: none)

    def state_of(self, keys: list[int]) -> int:
        """Optimizer state of ``keys``."""
        out = 0
        for k in keys:
            t = self.tensors[k]
            if t.state:
                out += t.state.of(t.numel)
        return out


def measure_model(
    module: nn.Module,
    batch: Any,
    precision: str = "32-true",
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    step: StepFn = default_step,
    tensor_parallel_size: int = 1,
    time_sizes: tuple[int, ...] | None = None,
    sync: Callable[[], None] | None = None,
    repeats: int = 3,
) -> ModelFacts:
    """Find the units, run the probe forwards, and size parameters, gradients and optimizer state.

    With ``tensor_parallel_size`` > 1, of one tensor-parallel rank's local model
    (:func:`~lightning_parallel.techniques.tensor_parallel.memory.local_model`); the optimizer is then
    built anew over its parameters, of the given optimizer's class and defaults. With ``time_sizes``
    (two micro-batch sizes, at most the batch's), each unit's forward and backward are also timed at
    those sizes (:func:`~lightning_parallel.planner.time_probe.measure_times`, the time model's facts);
    a model on the meta device cannot be timed (``times`` stays ``None``). ``sync``: a barrier the time
    probe calls before each timed run (``plan="auto"`` times on every rank at once); ``repeats``: its timed
    runs per size (the median kept).

    Raises:
        ValueError: unknown precision; a batch the model rejects; no optimizer to size.

    Example::

        facts = measure_model(CharLM(), (x, y))
    """
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISION_DTYPES)}")
    param_dtype, autocast_dtype = PRECISION_DTYPES[precision]
    optimizers = _optimizers(module, optimizer)
    reduces: dict[str, int] = {}
    if tensor_parallel_size > 1:
        tensor_plan = planned_tensors(module, tensor_parallel_size)
        module = local_model(module, tensor_plan, tensor_parallel_size)
        optimizers = [_rebuilt(o, module) for o in optimizers]
        reduces = row_splits(tensor_plan, [u.name for u in find_units(module).units])
    layout = find_units(module)
    samples = _samples(batch)
    probed = module if param_dtype is None else _converted(module, param_dtype)
    probe_layout = layout if probed is module else find_units(probed)
    probe = probe_activations(probed, probe_layout, batch, probe_sizes(samples), autocast_dtype, step)
    order_extras(layout, probe.first_call)
    sizes = state_sizes(optimizers, param_dtype)
    tensors, groups = _tensors(module, optimizers, sizes, param_dtype)
    unit_params = {u.name: [id(p) for p in u.module.parameters()] for u in layout.units}
    loose = [id(p) for p in layout.loose]
    times = None
    if time_sizes and not any(p.is_meta for p in probed.parameters()):
        times = measure_times(
            probed, probe_layout, batch, time_sizes, optimizers, step, repeats, autocast_dtype, sync
        )
    return ModelFacts(
        layout, probe, samples, precision, tensors, unit_params, loose, groups, tensor_parallel_size,
        times, reduces, _tokens(batch),
    )  # fmt: skip


def _optimizers(module: nn.Module, optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is not None:
        found = optimizers_from(optimizer)
    else:
        configure: Callable[[], Any] | None = getattr(module, "configure_optimizers", None)
        if configure is None:
            raise ValueError(
                f"{type(module).__name__} has no configure_optimizers: pass optimizer= (e.g. "
                f"torch.optim.AdamW(model.parameters())) to size the optimizer state"
            )
        try:
            found = optimizers_from(configure())
        except Exception as err:
            raise ValueError(
                f"{type(module).__name__}.configure_optimizers() failed outside a Trainer "
                f"({type(err).__name__}: {err}): pass optimizer= with the optimizer it builds (on the "
                f"command line: --optimizer AdamW, or another torch.optim class)"
            ) from err
    if not found:
        raise ValueError("no optimizer found: configure_optimizers (or optimizer=) returned none")
    return found


def _rebuilt(optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer's class over ``module``'s parameters, with the defaults its constructor accepts."""
    return type(optimizer)(module.parameters(), **accepted_settings(type(optimizer), optimizer.defaults))


def _tensors(
    module: nn.Module, optimizers: list, sizes: dict[int, StateSize], dtype: torch.dtype | None
) -> tuple[dict[int, Tensor], list[list[int]]]:
    group_of: dict[int, int] = {}
    groups: list[list[int]] = []
    for optimizer in optimizers:
        for group in getattr(optimizer, "_optimizer", optimizer).param_groups:
            groups.append([id(p) for p in group["params"]])
            for p in group["params"]:
                group_of[id(p)] = len(groups) - 1
    out = {}
    for p in module.parameters():
        size = torch.empty((), dtype=dtype or p.dtype).element_size()
        nbytes = p.numel() * size
        out[id(p)] = Tensor(
            id(p),
            p.numel(),
            nbytes,
            nbytes if p.requires_grad else 0,
            sizes.get(id(p)),
            group_of.get(id(p), -1),
            p.shape[0] if p.dim() else 1,
        )
    return out, groups


def _converted(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    return copy.deepcopy(module).to(dtype)


def _samples(batch: Any) -> int:
    for t in tree_leaves(batch):
        if torch.is_tensor(t) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError(f"the batch holds no tensor with a batch dimension ({type(batch).__name__})")


def _tokens(batch: Any) -> int:
    for t in tree_leaves(batch):
        if torch.is_tensor(t) and t.dim() > 1:
            return int(t.shape[1])
    return 0


__all__ = ["BEFORE", "ModelFacts", "Tensor", "measure_model"]


def planned_tensors(module: nn.Module, tp_size: int) -> TensorPlan:
    """The default tensor-parallel plan the strategy would split ``module`` with, found by the splits'
    finders (the Sequential's layers, else the traced path's plan with one rank's head counts)."""
    found = find_sequential(module)
    if found is not None:
        return default_plan(found[1], found[0], tp_size)
    return traced_plan(module, tp_size, local_heads=True)
