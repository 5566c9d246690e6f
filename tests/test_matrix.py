"""The configuration matrix (tests/matrix.py), each case against one device: one spawned job per world size.

Each rank of a job trains every case of its world size in turn, on the process group the job set up (as
under torchrun), validating after the second batch and training on (issue 51 item 8: an evaluation must
leave the stages as training needs them); the MLP's cases then predict. Every case is compared with a
one-device run of the same seed, data and Trainer settings: the loss of each batch, every parameter (the
ranks' stages gathered and merged), the validation losses, rank 0's logged losses, the predictions,
and each technique's own check (``matrix_checks.py``: FSDP2's one reduce-scatter per optimizer step,
offload's host counters, ZeRO-1's shares of the state, ...). A case resumed from another case's
checkpoint is compared with the reference's second epoch; after the 4-rank job, checkpoints it saved
are resumed on one device.

Covers techniques/fsdp/_internals.py (finish_backward, spied on), techniques/fsdp/ (technique, sharding),
techniques/zero.py, techniques/recompute/technique.py, techniques/replicas.py, techniques/user_function.py,
techniques/compile.py, techniques/offload/technique.py and techniques/tensor_parallel/technique.py through
every case they run in, and strategies/pipeline/step.py's evaluation between training batches.
"""

from __future__ import annotations

import contextlib
import re
import time
import traceback
from pathlib import Path
from typing import Any

import matrix
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from matrix import GLOBAL_BATCH, MODELS, TRAINER, VAL_BATCH, Case
from matrix_checks import CHECKS
from mp_harness import START_METHOD, SaveAtEpochEnd, assert_close_dicts, quiet_trainer, reference_loader
from tiny_models import loader

from lightning_parallel import PipelineStrategy, consolidate_checkpoint
from lightning_parallel._testing import spawn
from lightning_parallel.distributed.dtensors import full_tensors, local
from lightning_parallel.techniques import TECHNIQUES

TOLERANCE = {"32-true": dict(rtol=1e-5, atol=1e-6), "16-mixed": dict(rtol=1e-2, atol=2e-3)}
"""How close a case comes to one device, per precision: 16-mixed computes each micro-batch's gradients in
fp16 and adds them in fp32, one device the whole batch's in one fp16 product: close, not equal."""


class MemoryLogger(Logger):
    """Rank 0's logged metrics, kept in memory: ``(step, {name: value})`` per call."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    name, version = "memory", 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Recorder(Callback):
    """Every rank: the loss of each batch, each validation's loss, how each parameter is held when
    training starts, and when fitting ends the whole (gathered) parameters of its stages."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {"losses": [], "val": []}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record["held"] = {
            n: (type(p).__name__, str(getattr(p, "placements", "")), tuple(local(p).shape))
            for n, p in pl_module.named_parameters()
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record["losses"].append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.record["val"].append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer, pl_module) -> None:  # (a collective: every rank gathers)
        self.record["params"] = {
            k: v.detach().cpu().clone() for k, v in full_tensors(pl_module.state_dict()).items()
        }


class Snapshots(Callback):
    """The reference's parameters at the end of each epoch, and when each validation starts."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.at_validation: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.params.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.at_validation.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def _slug(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def _checkpoint(directory: str | Path, name: str) -> str:
    return f"{directory}/{_slug(name)}.ckpt"


# ------------------------------------------------------------------------------------ one device


def _reference(model: str, precision: str, directory: Path) -> dict[str, Any]:
    """Two epochs on one device, the first epoch's checkpoint saved (cases resume it)."""
    spec = MODELS[model]
    torch.manual_seed(0)
    module = spec.build()
    recorder, snapshots, logger = Recorder(), Snapshots(), MemoryLogger()
    ckpt = _checkpoint(directory, f"reference {model} {precision}")
    callbacks = [recorder, snapshots, SaveAtEpochEnd(ckpt)]
    trainer = quiet_trainer(max_epochs=2, callbacks=callbacks, logger=logger, default_root_dir=directory,
                            **TRAINER, **matrix.precision_plugins(precision))  # fmt: skip
    trainer.fit(module, reference_loader(spec.data(), GLOBAL_BATCH), loader(spec.val(), VAL_BATCH))
    optimizer = trainer.optimizers[0]
    named = dict(module.named_parameters(remove_duplicate=False))
    state_bytes = {n: sum(v.nbytes for v in optimizer.state[p].values()) if p in optimizer.state else 0
                   for n, p in named.items()}  # fmt: skip
    first = {id(p): n for n, p in reversed(list(named.items()))}
    aliases = {n: first[id(p)] for n, p in named.items() if first[id(p)] != n}
    return {**recorder.record, "snapshots": snapshots.params, "at_validation": snapshots.at_validation,
            "logged": _logged(logger), "checkpoint": ckpt, "state_bytes": state_bytes, "aliases": aliases,
            "states": len(optimizer.state)}  # fmt: skip


def _logged(logger: MemoryLogger) -> list[float]:
    return [m["train_loss"] for _, m in logger.logged if "train_loss" in m]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[tuple[str, str], dict[str, Any]]:
    """The one-device runs of every model and precision the cases use."""
    directory = tmp_path_factory.mktemp("references")
    needed = sorted({(c.model, c.precision) for c in matrix.all_cases()})
    return {key: _reference(*key, directory) for key in needed}


# ------------------------------------------------------------------------------------- the ranks


def _fit(case: Case, world: int, out_dir: str, refs_dir: str) -> dict[str, Any]:
    """One case on this rank: its fit (and the MLP's predictions), what it and its checks recorded."""
    spec = MODELS[case.model]
    replicas = case.plan.data_parallel_size
    checks = {t: CHECKS[t] for t in case.active() if t in CHECKS}
    recorder, logger = Recorder(), MemoryLogger()
    outs = {t: {} for t in checks}
    callbacks = [recorder, *([SaveAtEpochEnd(_checkpoint(out_dir, case.name))] if case.saves else [])]
    callbacks += [c for t, check in checks.items() if (c := check.callback(case, outs[t])) is not None]
    strategy = PipelineStrategy(
        num_microbatches=matrix.MICROBATCHES, **matrix.resolved(case.options, out_dir)
    )
    trainer = quiet_trainer(devices=world, strategy=strategy, callbacks=callbacks, logger=logger,
                            max_epochs=case.epochs, default_root_dir=out_dir, **TRAINER,
                            **matrix.precision_plugins(case.precision))  # fmt: skip
    if case.resumes is None:
        ckpt = None
    elif case.resumes == "reference":
        ckpt = _checkpoint(refs_dir, f"reference {case.model} {case.precision}")
    else:
        ckpt = _checkpoint(out_dir, case.resumes)
    torch.manual_seed(0)
    module = spec.build()
    with contextlib.ExitStack() as stack:
        for t, check in checks.items():
            stack.enter_context(check.context(case, outs[t]))
        trainer.fit(module, loader(spec.data(), GLOBAL_BATCH // replicas),
                    loader(spec.val(), VAL_BATCH // replicas), ckpt_path=ckpt)  # fmt: skip
    record = {**recorder.record, "logged": _logged(logger), "pp_rank": strategy.mesh.pp_rank,
              "dp_rank": strategy.mesh.rank("data")}  # fmt: skip
    for t, check in checks.items():
        record.update(outs[t], **check.record(trainer, module, case))
    if spec.predicts:
        record["predictions"] = trainer.predict(module, loader(spec.val(), VAL_BATCH // replicas))
    return record


def _job(rank: int, world: int, out_dir: str, refs_dir: str, cases: list[Case]) -> dict[str, dict]:
    records = {}
    for case in cases:
        start = time.process_time()
        try:
            records[case.name] = _fit(case, world, out_dir, refs_dir)
        except Exception as err:
            raise RuntimeError(f"case {case.name!r} failed on rank {rank}") from err
        records[case.name]["cpu_s"] = time.process_time() - start
    return records


# ------------------------------------------------------------------------------------ the checks


def _close(what: str, actual: Any, expected: Any, tolerance: dict) -> list[str]:
    try:
        if isinstance(expected, dict):
            assert_close_dicts(actual, expected, **tolerance)
        else:
            torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), **tolerance)
    except AssertionError as err:
        return [f"{what}: {str(err).strip().splitlines()[0]} ... {str(err).strip().splitlines()[-1]}"]
    return []


def _validated(case: Case, records: list[dict], params: dict, tolerance: dict) -> list[str]:
    """Each rank's validation loss: its replica's share of the validation batch (every ``replicas``-th
    sample, as Lightning's sampler deals them) and, split over ``k`` sequence-parallel ranks (the
    innermost: no tensor parallelism beside them), its contiguous ``1/k`` of each sample's tokens, on one
    device's weights when validation began."""
    spec, replicas = MODELS[case.model], case.plan.data_parallel_size
    k = case.plan.sequence_parallel_size
    module = spec.build()
    module.load_state_dict(params)
    x, y = spec.val().tensors
    autocast = torch.autocast("cpu", torch.float16, enabled=case.precision == "16-mixed")
    problems = []
    for rank, r in enumerate(records):
        with torch.no_grad(), autocast:
            out, target = module.eval()(x[r["dp_rank"] :: replicas]), y[r["dp_rank"] :: replicas]
            if k > 1:
                out, target = out.chunk(k, dim=1)[rank % k], target.chunk(k, dim=1)[rank % k]
            want = spec.loss(out, target).float()
        problems += _close(
            f"rank {rank}'s validation loss", torch.tensor(r["val"]), want.reshape(1), tolerance
        )
    return problems


def _problems(case: Case, records: list[dict], ref: dict) -> list[str]:
    """What differs from one device in ``case`` (its epoch: the first, or the second when resumed)."""
    tolerance = TOLERANCE[case.precision]
    epoch = 0 if case.resumes is None else 1
    batches = slice(3 * epoch, 3 * epoch + 3)
    params = {k: v for r in records for k, v in r["params"].items()}
    problems = _close("parameters", params, ref["snapshots"][epoch], tolerance)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    problems += _close("losses", losses, torch.tensor(ref["losses"][batches]), tolerance)
    problems += _validated(case, records, ref["at_validation"][epoch], tolerance)
    logged, per_epoch = records[0]["logged"], len(ref["logged"]) // 2
    if len(logged) != per_epoch:
        problems.append(f"rank 0 logged {len(logged)} training losses, one device {per_epoch}")
    elif case.plan.data_parallel_size == case.plan.sequence_parallel_size == 1:
        # (with replicas, rank 0 logs its replica's, as under DDP; split, its tokens' share)
        want = ref["logged"][per_epoch * epoch : per_epoch * (epoch + 1)]
        problems += _close("logged losses", logged, want, tolerance)
    if MODELS[case.model].predicts:
        module = MODELS[case.model].build()
        module.load_state_dict(ref["snapshots"][epoch])
        with torch.no_grad():
            want = module.eval()(MODELS[case.model].val().tensors[0])
        predicted = torch.cat(records[0]["predictions"]).float()  # (16-mixed predicts in fp16)
        problems += _close("predictions", predicted, want, tolerance)
    for technique in case.active():
        if technique in CHECKS:
            problems += [f"{technique}: {p}" for p in CHECKS[technique].verify(case, records, ref)]
    return problems


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", sorted({s.world for s in matrix.SHAPES}))
def test_every_case_trains_as_on_one_device(world, references, tmp_path):
    cases = matrix.cases(world)
    refs_dir = str(Path(next(iter(references.values()))["checkpoint"]).parent)
    ranks = spawn(_job, world, str(tmp_path), refs_dir, cases, start_method=START_METHOD)
    problems = []
    for case in cases:
        records = [r[case.name] for r in ranks]
        try:
            found = _problems(case, records, references[(case.model, case.precision)])
        except Exception:
            found = [traceback.format_exc()]
        problems += [f"{case.name}: {p}" for p in found]
    problems += _resumed_on_one_device(cases, references, tmp_path)
    # What each case costs (its ranks' CPU seconds, with -s): what matrix.MODELS' costs estimate.
    for case in sorted(cases, key=lambda c: -sum(r[c.name]["cpu_s"] for r in ranks)):
        seconds = sum(r[case.name]["cpu_s"] for r in ranks)
        print(f"{seconds:6.2f} CPU s (estimated {case.cost:4.0f})  {case.name}")
    assert not problems, "\n".join(problems)


def _resumed_on_one_device(cases: list[Case], references: dict, directory: Path) -> list[str]:
    """Every checkpoint a case saved, resumed on one device for the second epoch (a distributed one
    consolidated first): in turn with the Trainer alone and offloaded at pipeline size 1 (where the
    pipeline can resume it: not ZeRO-1's, :func:`matrix.resume_fails`). A file holds
    the whole optimizer state, every parameter's (not one replica's shard, not one stage's)."""
    problems = []
    for i, case in enumerate(c for c in cases if c.saves):
        ref, spec, tolerance = (
            references[(case.model, case.precision)],
            MODELS[case.model],
            TOLERANCE[case.precision],
        )
        where = f"{case.name}'s {case.saves} checkpoint on one device"
        ckpt = _checkpoint(directory, case.name)
        if case.saves == "dcp":
            consolidate_checkpoint(ckpt, f"{ckpt}.pt")
            ckpt = f"{ckpt}.pt"
        else:
            states = len(torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"])
            if states != ref["states"]:
                problems.append(
                    f"{where}: the optimizer state of {states} parameters, one device has {ref['states']}"
                )
        offloaded = i % 2 == 1 and matrix.resume_fails(case.options, {}) is None
        strategy = PipelineStrategy(pipeline_size=1, offload="optimizer") if offloaded else "auto"
        recorder = Recorder()
        torch.manual_seed(0)
        trainer = quiet_trainer(max_epochs=2, strategy=strategy, callbacks=[recorder],
                                default_root_dir=directory, **TRAINER,
                                **matrix.precision_plugins(case.precision))  # fmt: skip
        trainer.fit(spec.build(), reference_loader(spec.data(), GLOBAL_BATCH), loader(spec.val(), VAL_BATCH),
                    ckpt_path=ckpt)  # fmt: skip
        where += ", offloaded" if offloaded else ""
        problems += _close(f"{where}: parameters", recorder.record["params"], ref["snapshots"][1], tolerance)
        problems += _close(f"{where}: losses", recorder.record["losses"], ref["losses"][3:], tolerance)
    return problems


# ----------------------------------------------------------------------- the matrix itself (pure)


def test_every_technique_has_its_variants_and_runs_in_some_case():
    """A new technique in TECHNIQUES fails here until tests/matrix.py lists what its search does not try
    (and tests/matrix_checks.py its check, if it has one)."""
    names = [t.name for t in TECHNIQUES]
    assert set(matrix.NOT_SEARCHED) == set(names), "each technique's entry in matrix.NOT_SEARCHED"
    assert set(CHECKS) <= set(names)
    active = {t for c in matrix.all_cases() for t in c.active()}
    chosen = set(names) - set(matrix.ALWAYS_ON)
    assert all(not t.fields for t in TECHNIQUES if t.name in matrix.ALWAYS_ON)
    assert active == chosen, f"techniques no case runs: {sorted(chosen - active)}"


def test_every_variant_shape_model_and_pair_is_in_some_case():
    cases = matrix.all_cases()
    items = [matrix._items(c.shape, c.model, c.precision, c.chosen) for c in cases]
    impossible = set(matrix.infeasible())
    missing = [
        sorted(r) for r in matrix.requirements() if r not in impossible and not any(r <= i for i in items)
    ]
    assert not missing, missing
    # What cannot be met is what the plan refuses: no single variant, shape or model among it.
    assert all(len(r) == 2 for r in impossible), [sorted(r) for r in impossible if len(r) != 2]
    for a, b in (sorted(r) for r in impossible):
        factors = {a[0], b[0]}
        assert "shape" not in factors, (a, b)
    # Every variant the techniques' own search tries is here.
    table = matrix.variants()
    assert {"offload=optimizer", "offload=parameters", "offload=activations"} <= set(table["offload"])
    assert "data_parallel=zero1" in table["zero"] and "data_parallel=fsdp" in table["fsdp"]
    assert "activation_checkpointing=True" in table["recompute"]


def test_each_case_is_a_plan_the_strategy_accepts_and_checkpoints_chain():
    cases = matrix.all_cases()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names)
    for case in cases:
        PipelineStrategy(num_microbatches=matrix.MICROBATCHES, **case.options)  # accepted
        if case.resumes not in (None, "reference"):
            saved = next(c for c in cases if c.name == case.resumes)
            assert saved.saves and names.index(saved.name) < names.index(case.name)
            assert (saved.shape.world, saved.model, saved.precision) == (
                case.shape.world,
                case.model,
                case.precision,
            )
    assert {c.saves for c in cases} >= {"file", "dcp"}
    assert any(c.resumes == "reference" for c in cases)
