"""PipelineStrategy(compile=...): compiled stages train, validate and predict as one eager process does.

Every compiled case runs in one job per world size (a spawn pays seconds of imports, a cold inductor
compile tens of seconds): the 2-rank job (pp 2) fits the Sequential GPT (then validates and predicts),
the traced GPT with recomputation, a Hugging Face Llama, and the Sequential GPT under bf16-mixed; the
4-rank job (pp 2 x dp 2) the Sequential GPT with FSDP2 and with plain replicas. Inductor compiles the
Sequential GPT; the others run dynamo and AOTAutograd with eager kernels (aot_eager).
The jobs share one inductor cache: programs compiled with dynamic sizes for the same micro-batches are
found again.

The two jobs and the one-process eager references (in this process) run at the same time: a pipeline
compiles one stage at a time (the next stage waits for the previous one's output), so the 2-rank job
keeps one core busy of two. The 4-rank job's plain replicas wait for the 2-rank job's Sequential GPT to
be done, and then find its programs in the cache instead of compiling them a second time beside it.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
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
from tiny_models import SequentialGPT, TinyGPT, loader, token_data
from torch.distributed.fsdp import FSDPModule

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed.dtensors import full_tensors
from lightning_parallel.techniques.compile import (
    CompileWatch,
    checked_compile_options,
    compile_in_place,
    is_compiled,
)

VAL = token_data(8, seed=1)
BATCH = 8  # per replica: micro-batches of 2 in both jobs, so the 4-rank job finds the same programs
# One compile thread: on 2 cores inductor's pool of compile workers costs more than it saves.
INDUCTOR = {"options": {"compile_threads": 1}}


@dataclass(frozen=True)
class Case:
    model: str  # see _model
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    compile: dict[str, Any] = field(default_factory=lambda: INDUCTOR)
    validated: bool = False  # also validation and prediction (the forward-only schedule, eval mode)
    # 38 at pp 2: the epoch ends on a batch of 6 (3 micro-batches of 2), a new schedule for the same
    # compiled programs; 32 at pp 2 x dp 2 (a short batch there would hold micro-batches of one sample,
    # a size compiled programs specialise on)
    samples: int = 38
    # a case of the 2-rank job whose compiled programs this one finds in the shared cache: it starts
    # once that case is done (compiled beside it, they would be compiled twice)
    after: str = ""


CASES_2 = {  # pp 2 on 2 ranks
    "sequential": Case("sequential", validated=True),
    # aot_eager: dynamo and AOTAutograd over the traced stages' graphs with recomputation in them (what
    # the package compiles, with which options, and that nothing recompiles). Inductor's kernels are
    # the Sequential GPT's above: a second cold inductor program cost ~47 CPU s of C++ builds on 2 cores,
    # a quarter of this test, and no code of the package differs between the backends.
    "traced-recompute": Case("traced", dict(activation_checkpointing=True), compile={"backend": "aot_eager"}),
    # aot_eager (dynamo and AOTAutograd over the Llama's stage graphs, eager kernels): traced stages
    # under inductor are experiments/bench_compile.py's (exact to 5e-7 there).
    "llama": Case("llama", compile={"backend": "aot_eager"}),
    # aot_eager: what this case checks is the compiled stages under bf16-mixed's autocast (traced by
    # dynamo into the stage's graph); nothing of the package depends on the backend's kernels, and a
    # third inductor program would be a minute of C++ builds on 2 cores.
    # (3 blocks, not 4: dynamo compiles each block instance; the uniform split of the 6 children
    # (embedding, 3 blocks, norm, head) still gives each stage a block to compile)
    "sequential-bf16": Case("sgd", trainer=dict(precision="bf16-mixed"), compile={"backend": "aot_eager"}),
}
CASES_4 = {  # pp 2 x dp 2 on 4 ranks
    # aot_eager (dynamo and AOTAutograd, eager kernels): FSDP2's hooks break the blocks' graphs, so these
    # are new programs, which inductor would compile cold again on 4 ranks sharing 2 cores. First: it
    # needs nothing of the 2-rank job, which compiles meanwhile. 3 blocks, not 4 (a block still on each
    # stage): FSDP2's hooks break each block's graph in several, each compiled on each of 4 ranks.
    "sequential-fsdp-dp2": Case(
        "sequential-3", dict(data_parallel="fsdp"), compile={"backend": "aot_eager"}, samples=32
    ),
    "sequential-dp2": Case("sequential", samples=32, after="sequential"),
}


class CompileSeconds(L.Callback):
    """The strategy's compile seconds after each training batch: what each step compiled."""

    def __init__(self) -> None:
        self.after_batch: list[float] = []

    def on_train_batch_end(self, trainer, *_) -> None:
        self.after_batch.append(trainer.strategy.compile_seconds)


class SGDSequentialGPT(SequentialGPT):
    """SGD: a weight's difference between two runs is lr x the difference of its gradients. AdamW would
    turn bf16 rounding in a near-zero gradient into a step of up to lr in either direction."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _model(kind: str) -> L.LightningModule:
    """The tiny models of the other tests, with fewer blocks (less to compile) but the inductor-compiled
    Sequential GPT's (whose programs the 4-rank job's replicas find in the cache): the traced ones one a
    stage, the other Sequential GPTs 2 and 1."""
    torch.manual_seed(0)
    if kind == "llama":
        import transformers as tf
        from hf_models import HFCausalLM, hf_config

        model = HFCausalLM("llama", tied=True, call="logits", lr=1e-3, build=False)
        config = hf_config("llama", True)
        config.num_hidden_layers = 2
        model.model = tf.AutoModelForCausalLM.from_config(config)
        return model
    kinds = {
        "sequential": SequentialGPT,
        "sequential-3": lambda: SequentialGPT(depth=3),
        "sgd": lambda: SGDSequentialGPT(depth=3),
    }
    return kinds.get(kind, lambda: TinyGPT(depth=2))()


def _data(case: Case):
    if case.model == "llama":
        from hf_models import hf_token_data

        return hf_token_data(16), hf_token_data(8, seed=1)
    return token_data(case.samples), VAL


def _compiled_fits(rank: int, world: int, port: int, out_dir: str, cases: dict[str, Case]) -> None:
    """One rank of a job: every case as its own Trainer.fit in the same processes, compile time apart."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{out_dir}/../inductor"  # shared by both jobs
    torch.set_num_threads(1)
    for name, case in cases.items():
        if case.after:
            _wait_for_case(Path(out_dir).parent / "pp2" / case.after, ranks=2)
        strategy = PipelineStrategy(
            pipeline_size=2, num_microbatches=4, compile=case.compile, **case.strategy
        )
        recorder, seconds = RankRecorder(f"{out_dir}/{name}"), CompileSeconds()
        # inference_mode=False: prediction runs under no_grad as validation does, and finds its program
        trainer = quiet_trainer(devices=world, strategy=strategy, max_epochs=1, callbacks=[recorder, seconds],
                                num_sanity_val_steps=0, inference_mode=False, **case.trainer)  # fmt: skip
        data, val = _data(case)
        model = _model(case.model)
        trainer.fit(
            model, loader(data, BATCH), **(dict(val_dataloaders=loader(val, BATCH)) if case.validated else {})
        )
        layers = [m for stage in strategy.parts.runner.stages.modules for m in stage.children()]
        params = {k: v.detach().cpu() for k, v in full_tensors(model.state_dict()).items()}  # FSDP2: gathered
        facts = dict(compile_seconds=strategy.compile_seconds, compiled=any(map(is_compiled, layers)),
                     fsdp=any(isinstance(m, FSDPModule) for m in model.modules()), params=params,
                     after_batch=seconds.after_batch)  # fmt: skip
        if case.validated:
            facts["predictions"] = trainer.predict(model, loader(val, BATCH))
        torch.save(facts, f"{out_dir}/{name}/facts-rank{rank}.pt")


def _wait_for_case(case_dir: Path, ranks: int, timeout: float = 600.0) -> None:
    """Wait until every rank of another job has finished the case that writes ``case_dir``."""
    facts = [case_dir / f"facts-rank{r}.pt" for r in range(ranks)]
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in facts):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{case_dir.name} of the other job not done after {timeout:.0f} s")
        time.sleep(0.2)


def _reference(name: str, case: Case, out_dir, replicas: int) -> tuple[dict, L.LightningModule]:
    """The eager one-process run of ``case`` on the batches every replica sees together."""
    data, val = _data(case)
    model = _model(case.model)
    record = fit(model, reference_loader(data, BATCH * replicas), out_dir / "ref" / name, devices=1,
                 max_epochs=1, num_sanity_val_steps=0, **case.trainer,
                 **(dict(val_dataloaders=loader(val, BATCH)) if case.validated else {}))[0]  # fmt: skip
    return record, model


def _start_job(cases: dict[str, Case], world: int, out_dir) -> mp.ProcessContext:
    return mp.start_processes(_compiled_fits, args=(world, free_port(), str(out_dir), cases), nprocs=world,
                              start_method=START_METHOD, join=False)  # fmt: skip


def _check(name: str, case: Case, ref: dict, out_dir) -> list[dict]:
    # bf16-mixed: a compiled graph rounds to bf16 (8 significant bits: a relative step of 2**-8 = 0.4%)
    # where its ops and decompositions do, not always where eager does (inductor keeps a fused kernel's
    # intermediates in float32), so the two agree to a few such steps, not to float32's 1e-5: losses
    # and (SGD) weights within 1%.
    bf16 = case.trainer.get("precision") == "bf16-mixed"
    rtol, atol = (1e-2, 1e-3) if bf16 else (1e-5, 1e-5)
    records = load_rank_results(out_dir / name)
    facts = [torch.load(out_dir / name / f"facts-rank{r['rank']}.pt", weights_only=False) for r in records]
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")  # fmt: skip
    try:
        merged = merged_params([{"params": f["params"]} for f in facts])
        assert_close_dicts(merged, ref["params"], rtol=rtol, atol=atol)
    except AssertionError as err:
        raise AssertionError(f"{name}: {err}") from None
    if case.validated:
        for r in records:
            got, want = r["callback_metrics"]["val_loss"], ref["callback_metrics"]["val_loss"]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert all(f["compile_seconds"] > 0 for f in facts), f"{name}: a rank compiled nothing"
    for f in facts:  # compiled in the first step only: the short last batch runs the same programs
        assert len(set(f["after_batch"])) == 1, (name, f["after_batch"])
    if case.model != "traced" and case.model != "llama":  # the blocks compiled in place, no OptimizedModule
        assert all(f["compiled"] for f in facts), name
    assert all(f["fsdp"] for f in facts) == (case.strategy.get("data_parallel") == "fsdp"), name
    return facts


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_compiled_stages_train_validate_and_predict_as_one_eager_process(tmp_path):
    jobs = [_start_job(CASES_2, 2, tmp_path / "pp2"), _start_job(CASES_4, 4, tmp_path / "pp2dp2")]
    refs, models = {}, {}
    try:
        for replicas, cases in ((1, CASES_2), (2, CASES_4)):
            for name, case in cases.items():
                refs[name], models[name] = _reference(name, case, tmp_path, replicas)
    except BaseException:
        kill_jobs(jobs)
        raise
    join_jobs(jobs)
    for cases, out_dir in ((CASES_2, tmp_path / "pp2"), (CASES_4, tmp_path / "pp2dp2")):
        for name, case in cases.items():
            _check(name, case, refs[name], out_dir)
    # prediction through the compiled forward-only schedule: the tokens one eager process predicts
    eager = quiet_trainer(devices=1).predict(models["sequential"], loader(VAL, BATCH))
    got = torch.load(tmp_path / "pp2" / "sequential" / "facts-rank0.pt", weights_only=False)["predictions"]
    assert torch.equal(torch.cat(got), torch.cat(eager))


def test_compile_options_are_checked():
    assert checked_compile_options(True) == {"dynamic": True}
    given = {"dynamic": False, "mode": "default"}
    assert checked_compile_options(given) == given
    with pytest.raises(TypeError, match="unknown option 'fulgraph': did you mean 'fullgraph'"):
        PipelineStrategy(compile={"fulgraph": True})
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        PipelineStrategy(compile="inductor")
    for schedule in ("zbv", "dualpipev", "interleaved_zero_bubble"):
        with pytest.raises(ValueError, match=f"compile with schedule='{schedule}' is not supported.*'1f1b'"):
            PipelineStrategy(schedule=schedule, compile=True)
    with pytest.raises(ValueError, match="compile with tensor_parallel_size=2 is not supported"):
        PipelineStrategy(tensor_parallel_size=2, compile=True)


def test_a_module_compiled_by_the_user_is_refused_before_spawn_with_the_fix(tmp_path):
    strategy = PipelineStrategy(pipeline_size=2, start_method="spawn")
    trainer = quiet_trainer(devices=2, strategy=strategy, default_root_dir=tmp_path)
    fix = r"compiled with torch.compile\(model\).*PipelineStrategy\(compile=True\)"
    with pytest.raises(ValueError, match=fix):
        trainer.fit(torch.compile(SequentialGPT()), loader(VAL, 8))


def test_a_recompile_limit_reached_is_reported_with_the_fix():
    warned = []
    watch = CompileWatch(warned.append)
    block = TinyGPT().h[0]  # a block of user code (dynamo leaves torch's own modules to eager when alone)
    compile_in_place([("block", block)], {"backend": "eager", "dynamic": False, "recompile_limit": 1})
    watch.start()
    try:
        for n in (2, 3, 5):  # each new size a new program: the second one is over the limit
            block(torch.randn(1, n, 8))
    finally:
        watch.stop()
    assert watch.compilations >= 1 and watch.seconds > 0
    assert len(warned) == 1 and "recompile limit" in warned[0] and "padding_to_multiple" in warned[0]
    assert is_compiled(block) and type(block).__name__ == "Block"  # in place: no OptimizedModule


def test_a_torch_container_block_compiles():
    """Blocks that are torch's own modules (the MLP's nn.Sequential(Linear, Tanh)): Module.compile alone
    never runs dynamo on them (their frames lie in torch's files, which it skips); compile_in_place
    compiles them, and they compute what eager blocks do."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(2)]
    eager = [copy.deepcopy(b) for b in blocks]
    torch._dynamo.reset()
    counters.clear()
    compile_in_place([(str(i), b) for i, b in enumerate(blocks)], {"backend": "eager", "dynamic": True})
    out = ref = torch.randn(3, 4)
    for block, same in zip(blocks, eager):
        out, ref = block(out), same(ref)
    assert counters["frames"]["ok"] >= 1, dict(counters["frames"])
    assert all(is_compiled(b) for b in blocks)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
