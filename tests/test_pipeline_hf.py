"""Hugging Face decoders, built from a config and left unmodified, pipelined against one device.

Every family and way of calling runs in ONE pair of spawned processes (each fit there is a
``Trainer`` under the script launcher's environment, reusing the process group), since a spawn pays
seconds of imports: the one-device references run in this process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from mp_harness import (
    RankRecorder,
    assert_close_dicts,
    fit,
    free_port,
    load_rank_results,
    merged_params,
    quiet_trainer,
    reference_loader,
)
from tiny_models import loader

pytest.importorskip("transformers")

from hf_models import HFCausalLM, hf_token_data  # noqa: E402

from lightning_parallel import PipelineStrategy  # noqa: E402

# (family, tied, how the step calls the model, schedule): every family with both kinds of schedule
# between them, every way of calling at least twice.
CASES = [
    ("gpt2", True, "forward", "1f1b"),
    ("gpt2", True, "masked", "interleaved_1f1b"),
    ("llama", True, "logits", "interleaved_1f1b"),
    ("llama", False, "masked", "1f1b"),
    ("qwen2", False, "labels", "interleaved_1f1b"),
    ("qwen2", False, "logits", "1f1b"),
    ("mistral", False, "logits", "1f1b"),
    ("mistral", False, "forward", "interleaved_1f1b"),
    ("gemma", True, "forward", "interleaved_1f1b"),
    ("gemma", True, "labels", "1f1b"),
    ("neox", False, "labels", "1f1b"),
    ("neox", False, "masked", "interleaved_1f1b"),
]
STEPS = 2


def _name(case) -> str:
    family, tied, call, schedule = case
    return f"{family}-{'tied' if tied else 'untied'}-{call}-{schedule}"


def _data(call: str):
    return hf_token_data(16, padded=call == "masked")


def _model(case) -> HFCausalLM:
    family, tied, call, _ = case
    torch.manual_seed(0)
    return HFCausalLM(family, tied=tied, call=call, lr=1e-3)


def _pipelined_fits(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the job: every case as its own Trainer.fit, in the same two processes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    for case in CASES:
        schedule = case[3]
        strategy = PipelineStrategy(
            pipeline_size=2, num_microbatches=4, schedule=schedule,
            stages_per_rank=2 if schedule.startswith("interleaved") else 1,
        )  # fmt: skip
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS,
                                callbacks=[RankRecorder(f"{out_dir}/{_name(case)}")])  # fmt: skip
        trainer.fit(_model(case), loader(_data(case[2]), 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_hugging_face_families_train_as_on_one_device(tmp_path):
    refs = {}
    for case in CASES:
        refs[case] = fit(_model(case), reference_loader(_data(case[2]), 8), tmp_path / "ref" / _name(case),
                         devices=1, max_steps=STEPS)[0]  # fmt: skip
    mp.start_processes(
        _pipelined_fits, args=(2, free_port(), str(tmp_path / "pp")), nprocs=2, start_method="spawn"
    )
    for case in CASES:
        records = load_rank_results(tmp_path / "pp" / _name(case))
        ref = refs[case]
        losses = torch.tensor([r["losses"] for r in records]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, c=case: f"{_name(c)}: {m}")  # fmt: skip
        assert len(ref["losses"]) == STEPS
        assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-5)
