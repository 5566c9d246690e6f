"""Fine-tuning on real data, against one device: dynamic padding, prompts labelled -100, LoRA adapters.

The loss of every optimizer step must be the mean over all its labelled tokens, as one device computes
it on the whole global batch, whatever splits the batch: micro-batches, accumulated batches (Lightning's
``accumulate_grad_batches`` and GradientAccumulationScheduler), data-parallel replicas. Every case runs
in ONE job of 4 spawned processes (pipeline 2 x data parallel 2, pipeline 2 x tensor parallel 2, and
plain DDP over 4 ranks); the
one-device references run in this process. The batches have a new length nearly every time: the
traced path must trace once per mode, not per length. The callbacks are built in this process and reach
the ranks pickled, as a spawn launch (``strategy="ddp_spawn"``, ``start_method="spawn"``) sends them:
``TokenWeightedLoss(count=labelled_tokens(...))`` must travel and still count.

Covers strategies/pipeline/items.py (the user's count, or a Hugging Face model's own labels, per micro-batch)
and callbacks/token_loss.py under PipelineStrategy.
"""

from __future__ import annotations

import os
from pathlib import Path

import hf_env
import pytest
import torch
import torch.multiprocessing as mp
from finetune_models import (
    FineTune,
    PromptResponses,
    finetune_loader,
    labelled_in,
    pad_to_longest,
    reference_finetune_loader,
)
from lightning.pytorch.callbacks import Callback
from mp_harness import START_METHOD, assert_close_dicts, free_port, quiet_trainer

from lightning_parallel import (
    GradientAccumulationScheduler,
    PipelineStrategy,
    TokenWeightedLoss,
    labelled_tokens,
)
from lightning_parallel.distributed.dtensors import full_tensors

hf_env.require("peft")

WORLD, BATCH, ACCUMULATE, STEPS = 4, 4, 2, 2
TOKENS = labelled_tokens("labels", shift=True)  # what both loss styles average over


def _cases() -> dict[str, dict]:
    """name -> the model, strategy, callbacks and Trainer arguments of one fit on the 4 ranks."""
    return {
        # The model's own loss (labels=): its tokens counted automatically; Lightning's accumulation.
        "model-loss": dict(
            model=dict(loss="model"), pipeline=dict(), trainer=dict(accumulate_grad_batches=2)
        ),
        # The loss computed in training_step, its items declared; accumulation by our scheduler.
        "step-loss": dict(
            model=dict(loss="step"),
            pipeline=dict(schedule="gpipe"),
            callbacks=lambda: [
                TokenWeightedLoss(count=TOKENS),
                GradientAccumulationScheduler(global_batch_size=BATCH * 2 * ACCUMULATE),
            ],
        ),
        # LoRA adapters (peft), the base frozen; the stages sharded with FSDP2 over the replicas.
        "lora-fsdp": dict(
            model=dict(loss="model", adapters=True),
            pipeline=dict(data_parallel="fsdp"),
            trainer=dict(accumulate_grad_batches=2),
        ),
        # LoRA with the blocks split over 2 tensor-parallel ranks (pp 2 x tp 2: one replica).
        "lora-tp": dict(
            model=dict(loss="model", adapters=True),
            pipeline=dict(tensor_parallel_size=2),
            trainer=dict(accumulate_grad_batches=2),
            replicas=1,
        ),
        # No pipeline: plain DDP over the 4 ranks, Lightning's accumulation (Lightning issue #20350).
        "ddp": dict(
            model=dict(loss="step"),
            pipeline=None,
            callbacks=lambda: [TokenWeightedLoss(count=TOKENS)],
            trainer=dict(accumulate_grad_batches=2),
        ),
    }


class StepRecorder(Callback):
    """Per batch: the logged train_loss and the batch's labelled tokens; at the end the full weights."""

    def __init__(self, path: str) -> None:
        self.path, self.losses, self.items, self.lengths = path, [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.items.append(labelled_in(batch))
        self.lengths.append(batch["labels"].shape[1])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_fit_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        mesh = getattr(strategy, "mesh", None)
        stages = strategy.parts.runner.stages if isinstance(strategy, PipelineStrategy) else None
        state = trainer.optimizers[0].state
        record = {
            "losses": self.losses,
            "items": self.items,
            "lengths": self.lengths,
            "params": {k: v.detach().cpu() for k, v in full_tensors(pl_module.state_dict()).items()},
            "last_stage": mesh is None or mesh.pp_rank == mesh.pp_size - 1,
            "traces": getattr(stages, "traces", None),
            "frozen_with_state": sum(not p.requires_grad for p in state),
        }
        torch.save(record, self.path)


def _fits(rank: int, world: int, port: int, out_dir: str, callbacks: dict[str, list]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    for name, case in _cases().items():
        pipeline = case["pipeline"]
        strategy = (
            "ddp" if pipeline is None else PipelineStrategy(pipeline_size=2, num_microbatches=2, **pipeline)
        )
        recorder = StepRecorder(f"{out_dir}/{name}-rank{rank}.pt")
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS,
                                callbacks=[*callbacks[name], recorder],
                                **case.get("trainer", {}))  # fmt: skip
        model = FineTune(**case["model"])
        trainer.fit(model, finetune_loader(PromptResponses(64), BATCH))
        if name == "model-loss":  # the in-model loss of each micro-batch, merged by tokens
            trainer.validate(model, finetune_loader(_val_data(), 8), verbose=False)
            torch.save(float(trainer.callback_metrics["val_loss"]), f"{out_dir}/val-rank{rank}.pt")
        if name == "lora-fsdp":
            trainer.save_checkpoint(f"{out_dir}/lora.ckpt")


def _val_data() -> PromptResponses:
    return PromptResponses(8, seed=5)


def _reference(case: dict, tmp: Path) -> dict:
    """One device, one batch per optimizer step: every sample the ranks' accumulated batches hold."""
    replicas = case.get("replicas", WORLD if case["pipeline"] is None else 2)
    tmp.mkdir()
    recorder = StepRecorder(str(tmp / "ref.pt"))
    model = FineTune(**case["model"])
    trainer = quiet_trainer(devices=1, max_steps=STEPS, callbacks=[recorder])
    trainer.fit(model, reference_finetune_loader(PromptResponses(64), BATCH * replicas * ACCUMULATE))
    return {**torch.load(tmp / "ref.pt", weights_only=False), "model": model}


def _step_losses(records: list[dict]) -> list[float]:
    """Each optimizer step's token mean from the batches of the ranks that computed the loss."""
    batches = [
        (loss, items) for r in records if r["last_stage"] for loss, items in zip(r["losses"], r["items"])
    ]
    ranks = sum(r["last_stage"] for r in records)
    steps = []
    for step in range(STEPS):  # batches in rank order: rank r's batches k*A..k*A+A-1 belong to step k
        mine = [
            batches[r * STEPS * ACCUMULATE + step * ACCUMULATE + j]
            for r in range(ranks)
            for j in range(ACCUMULATE)
        ]
        steps.append(sum(loss * n for loss, n in mine) / sum(n for _, n in mine))
    return steps


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_finetuning_losses_are_token_exact_in_every_axis_and_lengths_are_traced_once(tmp_path):
    refs = {name: _reference(case, tmp_path / name) for name, case in _cases().items()}
    # Built here, pickled to each rank (the start method pickles the arguments), as a spawn launch does.
    callbacks = {name: case.get("callbacks", list)() for name, case in _cases().items()}
    args = (WORLD, free_port(), str(tmp_path), callbacks)
    mp.start_processes(_fits, args=args, nprocs=WORLD, start_method=START_METHOD)
    for name, case in _cases().items():
        records = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
        ref = refs[name]
        want = torch.tensor(ref["losses"], dtype=torch.float64)
        got = torch.tensor(_step_losses(records), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n} losses: {m}")
        merged = {k: v for r in records for k, v in r["params"].items()}  # the stages' (gathered) weights
        assert_close_dicts(merged, ref["params"], rtol=1e-5, atol=1e-6)
        if case["pipeline"] is not None:  # one trace per mode for every length (the one made at setup)
            assert {r["traces"] for r in records} == {1}, [r["traces"] for r in records]
        assert len({n for r in records for n in r["lengths"]}) >= 4, [r["lengths"] for r in records]
    assert all(
        r == 0
        for r in [torch.load(tmp_path / f"lora-fsdp-rank{k}.pt")["frozen_with_state"] for k in range(WORLD)]
    )
    _check_lora(refs["lora-fsdp"], tmp_path)
    _check_validation(refs["model-loss"], tmp_path)


def _check_lora(ref: dict, tmp: Path) -> None:
    """The base weights never moved, and the adapters go back to peft's own format."""
    from peft import PeftModel

    start = FineTune(loss="model", adapters=True)
    frozen = {k: v for k, v in start.state_dict().items() if "lora_" not in k}
    trained = {k: v for k, v in ref["params"].items() if "lora_" not in k}
    assert_close_dicts(trained, frozen, rtol=0, atol=0)
    adapted = FineTune.load_from_checkpoint(tmp / "lora.ckpt")
    adapted.model.save_pretrained(tmp / "adapters")
    assert (tmp / "adapters" / "adapter_config.json").exists()
    base = FineTune(loss="model").model
    reloaded = PeftModel.from_pretrained(base, tmp / "adapters")
    batch = pad_to_longest([PromptResponses(4, seed=9)[i] for i in range(4)])
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=batch["input_ids"]).logits, adapted.model(input_ids=batch["input_ids"]).logits
        )


def _check_validation(ref: dict, tmp: Path) -> None:
    """Replica 0's validation batch (every other sample), its two micro-batches' means merged by tokens."""
    data = _val_data()
    batch = pad_to_longest([data[i] for i in range(0, len(data), 2)])
    with torch.no_grad():
        want = float(ref["model"].eval()._loss(batch))
    got = torch.load(tmp / "val-rank0.pt")
    assert abs(got - want) < 1e-5, (got, want)
