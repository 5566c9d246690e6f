"""Each rank materialises and keeps only its own stage (meta-device init: strategies/pipeline/meta_init.py),
and knows its plan."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from mp_harness import START_METHOD, load_rank_results, quiet_trainer
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy


class RecordStageMemory(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        params = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        torch.save(
            {
                "rank": trainer.global_rank,
                "meta": sum(p.is_meta for p in params),
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "names": sorted(n for n, _ in pl_module.named_parameters()),
                "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
                "plan": trainer.strategy.plan,
            },
            f"{self.out_dir}/fit-rank{trainer.global_rank}.pt",
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_meta_initialised_model_materialises_only_the_local_stage(tmp_path):
    trainer = quiet_trainer(
        devices=2,
        max_steps=1,
        callbacks=[RecordStageMemory(tmp_path)],
        strategy=PipelineStrategy(pipeline_size=2, partition="parameters", start_method=START_METHOD),
    )
    with trainer.init_module(empty_init=True):
        model = SequentialRegressor(d_in=64, hidden=64, depth=7)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated in the main process
    full = {n: p.numel() * 4 for n, p in model.named_parameters()}
    trainer.fit(model, loader(regression_data(d_in=64), 8))

    records = load_rank_results(tmp_path)
    plan = records[0]["plan"]
    assert [s.num_parameters for s in plan.stages] == [sum(full[n] for n in r["names"]) // 4 for r in records]
    for record in records:
        assert record["meta"] == 0
        assert record["param_bytes"] == sum(full[n] for n in record["names"])
        assert record["optimizer_params"] == len(record["names"])
    assert sorted(records[0]["names"] + records[1]["names"]) == sorted(full)
    # balanced by parameters: the larger stage holds at most ~55% of the model
    assert max(r["param_bytes"] for r in records) <= 0.55 * sum(full.values())
    # the user's object in the main process gets real, trained weights back
    assert not any(p.is_meta for p in model.parameters())
    assert torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all()


class RecordTiedReplica(RecordStageMemory):
    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        record = torch.load(f"{self.out_dir}/fit-rank{trainer.global_rank}.pt", weights_only=False)
        tied = dict(pl_module.named_parameters(remove_duplicate=False))
        record["tied"] = next(tied[n].detach().clone() for n in ("wte.weight", "lm_head.weight") if n in tied)
        torch.save(record, f"{self.out_dir}/fit-rank{trainer.global_rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_meta_initialised_gpt_is_traced_on_meta_and_keeps_one_replica_per_stage(tmp_path):
    trainer = quiet_trainer(
        devices=2, max_steps=1, callbacks=[RecordTiedReplica(tmp_path)],
        strategy=PipelineStrategy(pipeline_size=2, start_method=START_METHOD),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = TinyGPT(dim=16, depth=4)
    assert all(p.is_meta for p in model.parameters())
    full = {n: p.numel() * 4 for n, p in model.named_parameters()}
    trainer.fit(model, loader(token_data(16), 8))

    first, last = load_rank_results(tmp_path)
    assert first["meta"] == 0 and last["meta"] == 0
    assert first["names"] == sorted(
        ["wte.weight", "wpe.weight", *(n for n in full if n.startswith(("h.0.", "h.1.")))]
    )
    assert "lm_head.weight" in last["names"] and "wte.weight" not in last["names"]
    # The tied weight was initialised by each rank, then every replica took the owner's (stage 0's) values.
    assert torch.equal(first["tied"], last["tied"])
    assert model.lm_head.weight is model.wte.weight and not model.wte.weight.is_meta
