"""LightningCLI: our callbacks from a YAML config by class_path, PipelineStrategy from the command line."""

import inspect
import os
import textwrap

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import (
    AllReducedMetrics,
    GradientAccumulationScheduler,
    PipelineStrategy,
    Rank0Checkpoint,
)
from lightning_parallel.io import atomic


class RegressionData(L.LightningDataModule):
    def __init__(self, samples: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def train_dataloader(self):
        return loader(regression_data(self.samples), self.batch_size)


CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_parallel.Rank0Checkpoint
      init_args:
        dirpath: {root}/ckpt
        every_n_epochs: 1
        save_last: link
        async_save: true
    - class_path: lightning_parallel.GradientAccumulationScheduler
      init_args:
        global_batch_size: {{0: 8, 2: 24}}
    - class_path: lightning_parallel.AllReducedMetrics
      init_args:
        reduce: {{train_loss: mean}}
"""


def test_callbacks_given_by_class_path_in_a_yaml_config_fit(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(CONFIG.format(root=tmp_path)))
    cli = LightningCLI(SequentialRegressor, RegressionData, args=["fit", "--config", str(config)])
    callbacks = {type(cb): cb for cb in cli.trainer.callbacks}
    assert callbacks[GradientAccumulationScheduler].global_batch_size == {0: 8, 2: 24}
    assert callbacks[Rank0Checkpoint].async_save and callbacks[Rank0Checkpoint].save_last == "link"
    assert isinstance(callbacks.get(AllReducedMetrics), AllReducedMetrics)
    # 8 batches an epoch; windows of 1, 1, 3, 3 batches, then 3, 3, 2: 7 optimizer steps.
    assert cli.trainer.global_step == 7
    last = tmp_path / "ckpt" / "last.ckpt"
    assert os.readlink(last) == "epoch=1-step=7.ckpt" and atomic.verify_checkpoint(str(last)).ok
    assert (tmp_path / "config.yaml").read_text().count("class_path: lightning_parallel.") == 3


@pytest.mark.parametrize("size_flag", ["pipeline_size", "num_stages"])
def test_pipeline_strategy_is_given_on_the_command_line(size_flag):
    args = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=lightning_parallel.PipelineStrategy",
        f"--trainer.strategy.{size_flag}=2",  # num_stages: the deprecated name still works
        "--trainer.strategy.schedule=gpipe",
        "--trainer.strategy.partition=[1, 3]",
        "--trainer.strategy.start_method=spawn",
    ]
    cli = LightningCLI(SequentialRegressor, RegressionData, run=False, args=args)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, PipelineStrategy)
    plan = strategy.parallel_plan
    assert (strategy.pipeline_size, plan.schedule, plan.partition) == (2, "gpipe", (1, 3))
    assert plan.num_microbatches == 4 and cli.trainer.num_devices == 2
    # The registered name works as well.
    cli = LightningCLI(SequentialRegressor, RegressionData, run=False, args=["--trainer.strategy=pipeline"])
    assert isinstance(cli.trainer.strategy, PipelineStrategy)


@pytest.mark.parametrize("cls", [AllReducedMetrics, GradientAccumulationScheduler, Rank0Checkpoint])
def test_constructor_annotations_are_types_not_strings(cls):
    # Tools that call inspect.signature (LightningCLI's parser, Lightning's own save_last test) use them.
    annotations = {n: p.annotation for n, p in inspect.signature(cls).parameters.items()}
    assert not [n for n, a in annotations.items() if isinstance(a, str)], annotations
