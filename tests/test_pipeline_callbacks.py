"""PipelineStrategy with the package's callbacks, 2 stages x 2 replicas, against one device."""

import csv
import glob

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from mp_harness import START_METHOD, assert_close_dicts, fit, reference_loader
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import AllReducedMetrics, GradientAccumulationScheduler, PipelineStrategy


def _logged(log_dir, key):
    rows = []
    for path in glob.glob(f"{log_dir}/**/metrics.csv", recursive=True):
        with open(path) as f:
            rows += [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]
    return sorted(rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_accumulation_and_all_reduced_metrics_under_pipeline_x_data_parallel(tmp_path):
    # 56 samples, global batch 32: per step 2 batches of 16 (one device) or 2 x (8 + 8) on 2
    # replicas; the epoch ends on a short window (16 + 8 samples) whose mean must stay exact.
    data = regression_data(56)
    val = regression_data(21, seed=1)  # odd: the replicas' evaluation shards differ in size
    common = dict(max_epochs=2, log_every_n_steps=1)

    def callbacks():
        return [GradientAccumulationScheduler(global_batch_size=32), AllReducedMetrics()]

    torch.manual_seed(0)
    ref = fit(
        SequentialRegressor(), reference_loader(data, 16), tmp_path / "ref", devices=1,
        val_dataloaders=loader(val, 4), callbacks=callbacks(),
        logger=CSVLogger(tmp_path / "ref", name="", version=""), **common,
    )[0]  # fmt: skip
    torch.manual_seed(0)
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=4, start_method=START_METHOD)
    records = fit(
        SequentialRegressor(), loader(data, 8), tmp_path / "pp", devices=4, strategy=strategy,
        val_dataloaders=loader(val, 4), callbacks=callbacks(),
        logger=CSVLogger(tmp_path / "pp", name="", version=""), **common,
    )  # fmt: skip
    assert_close_dicts({**records[0]["params"], **records[2]["params"]}, ref["params"])
    # Replicas of one stage hold the same parameters.
    assert_close_dicts(records[1]["params"], records[0]["params"], rtol=0, atol=0)
    for key in ("train_loss", "val_loss"):
        expected, got = _logged(tmp_path / "ref", key), _logged(tmp_path / "pp", key)
        assert [s for s, _ in got] == [s for s, _ in expected] and got, key
        torch.testing.assert_close(
            torch.tensor([v for _, v in got]), torch.tensor([v for _, v in expected]), rtol=1e-5, atol=1e-6
        )
