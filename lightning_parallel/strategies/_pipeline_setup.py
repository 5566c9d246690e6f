"""Choose the stage plan of a LightningModule for PipelineStrategy (partition, costs, checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_parallel.distributed.agree import decide_on
from lightning_parallel.pipeline.partition import (
    check_explicit,
    partition_balanced,
    partition_uniform,
)
from lightning_parallel.pipeline.plan import StagePlan, make_plan
from lightning_parallel.pipeline.profile import layer_times
from lightning_parallel.pipeline.proxy import CapturedInput
from lightning_parallel.pipeline.split import check_no_shared_parameters, check_parameters_inside, layer_facts
from lightning_parallel.pipeline.step_logs import LogRecorder

if TYPE_CHECKING:
    from lightning_parallel.strategies.pipeline import PipelineStrategy


def plan_for_module(
    strategy: PipelineStrategy,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    seq_name: str,
    seq: nn.Sequential,
) -> StagePlan:
    """The plan every rank agrees on (the "time" costs are measured on rank 0 and broadcast)."""
    check_parameters_inside(module, seq_name)
    names, types, params = layer_facts(seq)
    num_stages = strategy.pipeline_size * strategy.stages_per_rank  # <= len(seq): checked in _split
    costs: list[float] | None = None
    unit = ""
    if isinstance(strategy.partition, (list, tuple)):
        counts = check_explicit(strategy.partition, len(seq), num_stages)
    elif strategy.partition == "uniform":
        counts = partition_uniform(len(seq), num_stages)
    elif strategy.partition == "parameters":
        costs, unit = [float(p) for p in params], "parameters"
        counts = partition_balanced(costs, num_stages)
    else:
        costs, unit = _measured_costs(strategy, trainer, module, seq), "ms fwd+bwd"
        counts = partition_balanced(costs, num_stages)
    check_no_shared_parameters(seq, counts)
    return make_plan(
        names, types, params, counts, strategy.pipeline_size, strategy.data_parallel_size, costs, unit
    )


def _measured_costs(
    strategy: PipelineStrategy, trainer: pl.Trainer, module: pl.LightningModule, seq: nn.Sequential
) -> list[float]:

    def measure() -> list[float]:
        try:
            batch = strategy.batch_to_device(_first_training_batch(trainer))
            args = _sequential_input(module, seq, batch)
            return [1000.0 * t for t in layer_times(seq, args, strategy.root_device)]
        except Exception as err:
            raise RuntimeError(f'partition="time" could not measure the layers on rank 0: {err}') from None

    return decide_on(0, measure)


def _sequential_input(module: pl.LightningModule, seq: nn.Sequential, batch: Any) -> tuple[Any, ...]:
    """Run training_step until it calls the Sequential and return that call's arguments."""
    if any(p.is_meta for p in seq.parameters()):
        raise ValueError(
            'partition="time" times the real layers, but the model is on the meta device: use '
            'partition="parameters" or an explicit list with empty_init / configure_model'
        )

    def stop(_mod: nn.Module, args: tuple[Any, ...]) -> None:
        raise CapturedInput(args)

    handle = seq.register_forward_pre_hook(stop)
    try:
        with LogRecorder().recording(module, 1), torch.no_grad():
            module.training_step(batch, 0)
    except CapturedInput as captured:
        return captured.args
    finally:
        handle.remove()
    raise RuntimeError("training_step never called the pipelined Sequential")


def _first_training_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader, before Lightning's fit loop has set it up.

    Lightning 2.6.6 keeps the user's loader in the private ``fit_loop._data_source``; no public
    accessor exists at strategy setup. test_pipeline_partition.py fails loudly if this moves.
    """
    loader = trainer.fit_loop._data_source.dataloader()
    return next(iter(loader))
