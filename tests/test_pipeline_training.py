"""PipelineStrategy training against one device: same seed, data and global batch -> same numbers.

Here what the configuration matrix does not do (tests/matrix.py: every schedule, shape and technique,
run by tests/test_matrix.py): ranks started by Lightning's own launcher, a CSV log, changing sequence
lengths with a validation batch size of their own.

Covers strategies/pipeline/strategy.py, strategies/pipeline/setup.py (the set-up's order),
strategies/pipeline/step_hooks.py (Lightning's step, backward and optimizer_step hooks),
strategies/pipeline/step.py (a training step through the schedule) and strategies/pipeline/step_results.py
(the last stage's loss and logs on every rank).
"""

import csv
import glob

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from mp_harness import START_METHOD, assert_close_dicts, fit, reference_loader
from tiny_models import SequentialRegressor, TokenModel, VariableLengthTokens, loader, regression_data

from lightning_parallel import PipelineStrategy

# 58 samples: with per-replica batch 16 (or 8 per replica at 2 replicas) the epoch ends on a short
# batch that num_microbatches=4 does not divide -> a second schedule for that shape, fewer micro-batches.
N_SAMPLES = 58


def _logged(log_dir, key):
    rows = []
    for path in glob.glob(f"{log_dir}/**/metrics.csv", recursive=True):
        with open(path) as f:
            rows += [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    return rows


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_training_launched_by_lightning_matches_single_device_and_comes_back(tmp_path):
    """Lightning's own launcher starts the ranks (every schedule, shape and technique against one device
    is a case of the configuration matrix, tests/test_matrix.py, on ranks the test starts): the weights
    come back into the user's module, and rank 0's CSV log holds one device's losses."""
    cfg = dict(pipeline_size=2, schedule="1f1b")
    devices = 2
    dp = devices // cfg["pipeline_size"]
    global_batch = 16
    data = regression_data(N_SAMPLES)

    torch.manual_seed(0)
    ref_model = SequentialRegressor()
    ref = fit(
        ref_model,
        reference_loader(data, global_batch),
        tmp_path / "ref",
        devices=1,
        max_epochs=2,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path / "ref" / "logs", name="", version=""),
        log_every_n_steps=1,
    )[0]

    torch.manual_seed(0)
    model = SequentialRegressor()
    strategy = PipelineStrategy(num_microbatches=4, start_method=START_METHOD, **cfg)
    records = fit(
        model,
        loader(data, global_batch // dp),
        tmp_path / "pp",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_path / "pp" / "logs", name="", version=""),
        log_every_n_steps=1,
    )
    # Every rank holds only its stage's parameters, under the unsplit keys.
    merged = {}
    for r in records:
        assert not set(r["params"]) & set(merged) or dp > 1
        merged.update(r["params"])
    assert_close_dicts(merged, ref["params"], rtol=1e-5, atol=1e-6)
    # The spawn launcher brings every stage's weights back into the user's module.
    assert_close_dicts(dict(model.state_dict()), ref["params"], rtol=1e-5, atol=1e-6)
    # The per-batch loss (weighted over micro-batches, replicas averaged) and rank 0's CSV log.
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    ref_logged = _logged(tmp_path / "ref" / "logs", "train_loss")
    pp_logged = _logged(tmp_path / "pp" / "logs", "train_loss")
    assert len(pp_logged) == len(ref_logged) > 0
    if dp == 1:  # without a metric sync, rank 0 logs its replica's value (as under DDP)
        torch.testing.assert_close(torch.tensor(pp_logged), torch.tensor(ref_logged), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_changing_sequence_lengths_and_validation_batch_size(tmp_path):
    """Batches of 3, 4 and 5 tokens, a short last batch, and a validation batch size of its own."""
    data = VariableLengthTokens(n=44, batch_size=8)
    val = VariableLengthTokens(n=15, batch_size=5, seed=1)
    kw = dict(max_epochs=1, use_distributed_sampler=False, log_every_n_steps=1, limit_val_batches=None)

    torch.manual_seed(0)
    ref = fit(
        TokenModel(), loader(data, 8), tmp_path / "ref", devices=1, val_dataloaders=loader(val, 5),
        logger=CSVLogger(tmp_path / "ref" / "logs", name="", version=""), **kw,
    )[0]  # fmt: skip
    torch.manual_seed(0)
    model = TokenModel()
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=4, schedule="1f1b", start_method=START_METHOD
    )
    records = fit(
        model, loader(data, 8), tmp_path / "pp", devices=2, strategy=strategy,
        val_dataloaders=loader(val, 5), logger=CSVLogger(tmp_path / "pp" / "logs", name="", version=""), **kw,
    )  # fmt: skip
    assert_close_dicts({**records[0]["params"], **records[1]["params"]}, ref["params"], rtol=1e-5, atol=1e-6)
    for key in ("train_loss", "val_loss"):
        ref_values, pp_values = (
            _logged(tmp_path / "ref" / "logs", key),
            _logged(tmp_path / "pp" / "logs", key),
        )
        assert len(pp_values) == len(ref_values) > 0, key
        torch.testing.assert_close(torch.tensor(pp_values), torch.tensor(ref_values), rtol=1e-5, atol=1e-6)
