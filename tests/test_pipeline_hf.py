"""Hugging Face decoders, built from a config and left unmodified, pipelined against one device.

Every family and way of calling runs in ONE pair of spawned processes (each fit there is a
``Trainer`` under the script launcher's environment, reusing the process group), since a spawn pays
seconds of imports: the one-device references run in this process.

Covers sources/traced/call_binding.py (keyword calls, constants baked in, a ModelOutput rebuilt) under
PipelineStrategy, sources/traced/graph_regions.py (the decoders' rotary tables, computed under no_grad
and read by every block, inlined: pytorch#184361), and sources/traced/share.py: each fit's traces are
exported once, on rank 0, for both ranks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
import torch.multiprocessing as mp
from hf_models import HFCausalLM, LitGPTLM, PretrainedCausalLM, hf_model, hf_token_data
from mp_harness import (
    START_METHOD,
    RankRecorder,
    assert_close_dicts,
    fit,
    free_port,
    join_jobs,
    kill_jobs,
    load_rank_results,
    merged_params,
    quiet_trainer,
    reference_loader,
)
from third_party_models import image_data, third_party_model, token_data
from tiny_models import loader

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed.dtensors import full_tensors
from lightning_parallel.sources.traced.share import tally

# (family, tied, how the step calls the model, schedule): every family, both kinds of schedule for the
# four with the most unusual blocks (learned positions, tied and untied RoPE, scaled embeddings,
# parallel residual with partial rotary), every way of calling at least twice. Spawns and traces are
# the suite's budget: Qwen2 and Mistral, Llama's layout with q/k/v biases or sliding windows, run once.
CASES = [
    ("gpt2", True, "forward", "1f1b"),
    ("gpt2", True, "masked", "interleaved_1f1b"),
    ("llama", True, "logits", "interleaved_1f1b"),
    ("llama", False, "masked", "1f1b"),
    ("qwen2", False, "labels", "interleaved_1f1b"),
    ("mistral", False, "logits", "1f1b"),
    ("gemma", True, "forward", "interleaved_1f1b"),
    ("gemma", True, "labels", "1f1b"),
    ("neox", False, "labels", "1f1b"),
    ("neox", False, "masked", "interleaved_1f1b"),
    # litgpt's GPT from a Config (Lightning's own LLM library), when installed (make test installs it)
    ("litgpt:pythia-14m", None, "litgpt", "1f1b"),
    ("litgpt:Llama-3.2-1B", None, "litgpt", "interleaved_1f1b"),
    ("litgpt:Qwen2.5-0.5B", None, "litgpt", "1f1b"),
    ("litgpt:gemma-2b", None, "litgpt", "interleaved_1f1b"),
]
if importlib.util.find_spec("litgpt") is None and not os.environ.get("CI"):  # CI: make test installs it
    CASES = [c for c in CASES if c[2] != "litgpt"]
# Models from outside transformers and litgpt (third_party_models.py), in the same job: x-transformers'
# decoder (autocast on its inputs' device in its rotary helpers, blocks that are containers), minGPT's
# layout, torchtitan's Llama 3 layout (blocks in a ModuleDict, complex rotary buffer), a ViT.
OTHERS = [
    ("x-transformers", "1f1b"),
    ("mingpt", "interleaved_1f1b"),
    ("torchtitan-llama", "1f1b"),
    ("vit", "interleaved_1f1b"),
]
if importlib.util.find_spec("x_transformers") is None and not os.environ.get("CI"):  # make test installs it
    OTHERS = [c for c in OTHERS if c[0] != "x-transformers"]
STEPS = 2
FSDP_CASE = ("llama", True, "logits", "interleaved_1f1b")  # its one-device reference, sharded with FSDP2
VALIDATED = {("qwen2", False, "labels", "interleaved_1f1b"), ("llama", False, "masked", "1f1b")}


def _name(case) -> str:
    family, tied, call, schedule = case
    return f"{family.replace(':', '-')}-{'tied' if tied else 'untied'}-{call}-{schedule}"


def _data(call: str):
    return hf_token_data(16, padded=call == "masked")


def _val(case):
    return (
        dict(val_dataloaders=loader(hf_token_data(8, seed=1, padded=case[2] == "masked"), 8))
        if case in VALIDATED
        else {}
    )


def _layers(schedule: str) -> int:
    """One block per stage: 4 for an interleaved schedule (2 stages on each of 2 ranks), 2 for 1F1B. The
    export and the cut into stages cost in proportion to the blocks traced (~40% less for 2)."""
    return 4 if schedule.startswith("interleaved") else 2


def _model(case) -> HFCausalLM:
    family, tied, call, schedule = case
    torch.manual_seed(0)
    if call == "litgpt":
        return LitGPTLM(family.removeprefix("litgpt:"), layers=_layers(schedule))
    return HFCausalLM(family, tied=tied, call=call, lr=1e-3, layers=_layers(schedule))


def _other_data(name: str):
    return image_data(16) if name == "vit" else token_data(16)


def _pretrained(out_dir: str, **kw) -> PretrainedCausalLM:
    return PretrainedCausalLM("llama", tied=True, weights=f"{out_dir}/pretrained", layers=2, **kw)  # (1F1B)


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
        trainer.fit(_model(case), loader(_data(case[2]), 8), **_val(case))
    for name, schedule in OTHERS:
        strategy = PipelineStrategy(
            pipeline_size=2, num_microbatches=4, schedule=schedule,
            stages_per_rank=2 if schedule.startswith("interleaved") else 1,
        )  # fmt: skip
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS,
                                callbacks=[RankRecorder(f"{out_dir}/{name}")])  # fmt: skip
        trainer.fit(third_party_model(name), loader(_other_data(name), 8))
    # Fine-tuning saved weights: built on the meta device, each rank reads its stage from the files;
    # the consolidated checkpoint goes back to the Hugging Face format in the test.
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=4)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS,
                            callbacks=[RankRecorder(f"{out_dir}/pretrained-run")])  # fmt: skip
    trainer.fit(_pretrained(out_dir), loader(_data("logits"), 8))
    trainer.save_checkpoint(f"{out_dir}/pretrained-run/last.ckpt")
    # FSDP2 on the traced path: the tied Llama as one stage, sharded over both ranks (each its half of
    # every batch); the gathered weights are saved by every rank.
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=2, data_parallel="fsdp")
    recorder = RankRecorder(f"{out_dir}/fsdp")
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS, callbacks=[recorder])
    model = _model(FSDP_CASE)
    trainer.fit(model, loader(_data(FSDP_CASE[2]), 4))
    held = {type(p).__name__ for p in model.parameters()}
    params = {k: v.detach().cpu() for k, v in full_tensors(model.state_dict()).items()}
    torch.save({"losses": recorder.losses, "params": params, "held": held}, f"{out_dir}/fsdp-rank{rank}.pt")
    torch.save(dataclasses.asdict(tally), f"{out_dir}/exports-rank{rank}.pt")


def _references(tmp_path):
    """The one-device runs: the pretrained Llama's, each case's, each other model's."""
    ref_pretrained = fit(_pretrained(str(tmp_path / "pp")), reference_loader(_data("logits"), 8),
                         tmp_path / "ref" / "pretrained", devices=1, max_steps=STEPS)[0]  # fmt: skip
    refs = {}
    for case in CASES:
        refs[case] = fit(_model(case), reference_loader(_data(case[2]), 8), tmp_path / "ref" / _name(case),
                         devices=1, max_steps=STEPS, **_val(case))[0]  # fmt: skip
    others = {
        name: fit(third_party_model(name), reference_loader(_other_data(name), 8), tmp_path / "ref" / name,
                  devices=1, max_steps=STEPS)[0]
        for name, _ in OTHERS
    }  # fmt: skip
    return ref_pretrained, refs, others


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_hugging_face_families_train_as_on_one_device(tmp_path):
    torch.manual_seed(1)
    hf_model("llama", tied=True, layers=2).save_pretrained(tmp_path / "pp" / "pretrained")
    # The job runs while this process computes the one-device references: its rank 1 waits while rank 0
    # exports each fit's programs, and this process would wait for the whole job.
    job = mp.start_processes(_pipelined_fits, args=(2, free_port(), str(tmp_path / "pp")), nprocs=2,
                             start_method=START_METHOD, join=False)  # fmt: skip
    try:
        ref_pretrained, refs, others = _references(tmp_path)
    except BaseException:
        kill_jobs([job])
        raise
    join_jobs([job])
    for name, ref in others.items():
        records = load_rank_results(tmp_path / "pp" / name)
        losses = torch.tensor([r["losses"] for r in records]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
        try:
            assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    for case in CASES:
        records = load_rank_results(tmp_path / "pp" / _name(case))
        ref = refs[case]
        losses = torch.tensor([r["losses"] for r in records]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, c=case: f"{_name(c)}: {m}")  # fmt: skip
        assert len(ref["losses"]) == STEPS
        try:
            assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{_name(case)}: {err}") from None
        if case in VALIDATED:  # validation through the forward-only schedule, the in-model loss averaged
            for r in records:
                got, want = r["callback_metrics"]["val_loss"], ref["callback_metrics"]["val_loss"]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    sharded = [torch.load(tmp_path / "pp" / f"fsdp-rank{r}.pt", weights_only=False) for r in range(2)]
    for record in sharded:  # every rank gathered the same full weights, each held its shards
        assert record["held"] == {"DTensor"}, record["held"]
        assert_close_dicts(record["params"], refs[FSDP_CASE]["params"], rtol=1e-5, atol=1e-5)
    losses = torch.tensor([r["losses"] for r in sharded]).mean(0)  # the two halves of each batch
    torch.testing.assert_close(losses, torch.tensor(refs[FSDP_CASE]["losses"]), rtol=1e-5, atol=1e-6)
    records = load_rank_results(tmp_path / "pp" / "pretrained-run")
    assert_close_dicts(merged_params(records), ref_pretrained["params"], rtol=1e-5, atol=1e-5)
    # One export for both ranks, each time: every fit's at setup, and the evaluation mode's
    # (sources/traced/share.py).
    exports = [torch.load(tmp_path / "pp" / f"exports-rank{r}.pt") for r in range(2)]
    print(f"exports by rank: {exports}")
    assert exports[1]["exported"] == 0 and exports[0]["exported"] == exports[1]["received"] > 0, exports
    assert exports[0]["unshared"] == 0, exports
    # Back to the Hugging Face format: the consolidated checkpoint -> plain module -> save_pretrained.
    from transformers import AutoModelForCausalLM

    plain = PretrainedCausalLM.load_from_checkpoint(tmp_path / "pp" / "pretrained-run" / "last.ckpt")
    assert plain.model.lm_head.weight is plain.model.model.embed_tokens.weight
    plain.model.save_pretrained(tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    reference = hf_model("llama", tied=True, layers=2).eval()
    reference.load_state_dict({k.removeprefix("model."): v for k, v in ref_pretrained["params"].items()})
    idx = _data("logits").tensors[0][:4]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=idx).logits, reference(input_ids=idx).logits,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
