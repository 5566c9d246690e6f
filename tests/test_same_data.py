"""strategies/pipeline/same_data.py: every stage of a pipeline reads the same samples, whatever the sampler.

A model that carries each sample's id from the first stage to the last (a column no layer touches)
counts, on the last stage, the samples whose carried id is not the id the last stage read. Under
``PipelineStrategy(pipeline_size=2)`` on 2 gloo ranks (one replica) that count must be 0 with a
user's ``DistributedSampler`` (the DDP idiom, made in ``train_dataloader``/``val_dataloader``), with
``ResumableDistributedSampler(dataset)`` (the README's loader) in fit, test and predict; a sampler set
by hand to another layout is refused before any step; a loader that is not split by a sampler but
still differs per rank is caught by the first batch's comparison, on both ranks. One spawned job runs
every Trainer; each check fails on the code before the fix (mismatches 1008.8-like, no error).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from mp_harness import quiet_trainer, spawn_gloo
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_parallel import PipelineStrategy, ResumableDistributedSampler

N, D, BATCH, STEPS = 32, 3, 4, 4


class IdData(Dataset):
    """Sample ``i``: fixed features and its id ``i``."""

    def __init__(self) -> None:
        self.x = torch.randn(N, D, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], i


class CarryId(nn.Module):
    """A layer on the features; the last column (the id) passes through untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tanh(self.linear(h[:, :-1])), h[:, -1:]], dim=1)


class IdCarrier(L.LightningModule):
    """Counts, per stage of the Trainer, the samples whose carried id differs from the last stage's id."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(CarryId(), CarryId(), CarryId(), CarryId())
        self.seen: dict[str, list[float]] = {}

    def _carried(self, batch, stage: str) -> torch.Tensor:
        x, ids = batch
        out = self.layers(torch.cat([x, ids[:, None].float()], dim=1))
        # Only the last stage gets here (the first stops at the pipelined call).
        count = self.seen.setdefault(stage, [0.0, 0])
        count[0] += float((out[:, -1] - ids.float()).abs().sum().detach())
        count[1] += len(ids)
        return out

    def training_step(self, batch, batch_idx):
        return self._carried(batch, "train")[:, :-1].square().mean()

    def validation_step(self, batch, batch_idx):
        self._carried(batch, "val")

    def test_step(self, batch, batch_idx):
        self._carried(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self._carried(batch, "predict")[:, -1] - batch[1].float()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DDPIdiom(IdCarrier):
    """``DistributedSampler(dataset)`` made in the loader hooks, as DDP code and the guides write it."""

    def __init__(self, data: IdData) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self):
        return DataLoader(self.data, BATCH, sampler=DistributedSampler(self.data))

    def val_dataloader(self):
        return DataLoader(self.data, BATCH, sampler=DistributedSampler(self.data, shuffle=False))


def _trainer(**kwargs) -> L.Trainer:
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2)
    return quiet_trainer(devices=2, strategy=strategy, max_steps=STEPS, **kwargs)


def _outcome(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _ddp_idiom(data: IdData) -> dict:
    model = DDPIdiom(data)
    trainer = _trainer(limit_val_batches=2, val_check_interval=2)
    trainer.fit(model)
    sampler = trainer.train_dataloader.sampler
    return {"seen": model.seen, "layout": (sampler.num_replicas, sampler.rank)}


def _resumable(data: IdData) -> dict:
    """The README's loader, made before the Trainer; test and predict loaders with samplers too."""
    loader = DataLoader(data, BATCH, sampler=ResumableDistributedSampler(data))
    model = IdCarrier()
    trainer = _trainer()
    trainer.fit(model, loader)
    layout = (loader.sampler.num_replicas, loader.sampler.rank)
    trainer.test(model, DataLoader(data, BATCH, sampler=ResumableDistributedSampler(data, shuffle=False)))
    predicted = trainer.predict(
        model, DataLoader(data, BATCH, sampler=DistributedSampler(data, shuffle=False))
    )
    gaps = torch.cat(predicted).abs().sum().item() if predicted else None  # global rank 0 returns them
    return {"seen": model.seen, "layout": layout, "predicted": gaps}


def _set_by_hand(data: IdData, rank: int) -> str | None:
    """A sampler given another layout by hand (the ranks swapped): refused before the first step."""
    sampler = DistributedSampler(data, num_replicas=2, rank=1 - rank)
    return _outcome(lambda: _trainer().fit(IdCarrier(), DataLoader(data, BATCH, sampler=sampler)))


def _rank_dependent(data: IdData, rank: int) -> dict:
    """No distributed sampler, but a different subset on each rank: the first batch's comparison."""
    model = IdCarrier()
    subset = Subset(data, list(range(rank, N, 2)))
    error = _outcome(lambda: _trainer().fit(model, DataLoader(subset, BATCH)))
    return {"error": error, "seen": model.seen}


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    data = IdData()
    record = {
        "ddp_idiom": _ddp_idiom(data),
        "resumable": _resumable(data),
        "set_by_hand": _set_by_hand(data, rank),
        "rank_dependent": _rank_dependent(data, rank),
    }
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    return spawn_gloo(_job, 2, tmp_path_factory.mktemp("same_data"))


def _last_stage_counts(records: list[dict], run: str, stage: str) -> tuple[float, int]:
    first, last = records[0][run]["seen"], records[1][run]["seen"]
    assert stage not in first  # the first stage never reaches the user's code after the model call
    return tuple(last[stage])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_users_distributed_sampler_is_split_over_the_replicas(records):
    for stage, samples in (("train", STEPS * BATCH), ("val", 2 * BATCH)):
        mismatch, seen = _last_stage_counts(records, "ddp_idiom", stage)
        assert seen >= samples and mismatch == 0.0, (stage, mismatch, seen)  # > 0 before the fix
    assert [r["ddp_idiom"]["layout"] for r in records] == [(1, 0), (1, 0)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_resumable_sampler_takes_the_replicas_by_itself(records):
    for stage, samples in (("train", STEPS * BATCH), ("test", N), ("predict", N)):
        mismatch, seen = _last_stage_counts(records, "resumable", stage)
        assert seen == samples and mismatch == 0.0, (stage, mismatch, seen)  # 1008.8 in training before
    assert [r["resumable"]["layout"] for r in records] == [(1, 0), (1, 0)]
    assert records[0]["resumable"]["predicted"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_sampler_set_by_hand_to_another_layout_is_refused_with_the_fix(records):
    for rank, record in enumerate(records):
        error = record["set_by_hand"]
        assert error is not None and error.startswith("ValueError"), error
        assert f"num_replicas=2, rank={1 - rank}" in error
        assert "replica is rank 0 of num_replicas=1" in error
        assert "trainer.strategy.distributed_sampler_kwargs" in error


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ranks_reading_different_batches_stop_at_the_first_step_on_every_rank(records):
    for record in records:
        error = record["rank_dependent"]["error"]
        assert error is not None and error.startswith("ValueError"), error
        assert "data-parallel replica 0 read different training batches at batch 0" in error
        assert "global rank 0 (pipeline rank 0) and global rank 1 (pipeline rank 1)" in error
        assert "batch[0], batch[1]" in error and "distributed_sampler_kwargs" in error
        assert record["rank_dependent"]["seen"] == {}  # stopped before the schedule ran a step
