"""The configuration matrix: the pipeline shapes, the models and every technique's variants, as data.

As torchtitan's ``tests/integration_tests/features.py``: one declarative list of configurations and one
runner (``test_matrix.py``: per world size one spawned job trains every case of that size, validating
mid-epoch, against one device). A case is a pipeline shape (world size, pipeline size, schedule), a
model, a precision, and one variant (or none) of each technique of ``TECHNIQUES``. The variants are what
each technique's own ``variants()`` lets the planner's search try, plus those the search does not try,
listed in :data:`NOT_SEARCHED` (a new technique adds its entry there, and its checks in
``matrix_checks.py``). Which combinations run comes from the matrix, not from whoever thought of them
(:func:`cases`): every shape, model and variant at least once, and the pairs of :func:`requirements`
(two variants; a model and a technique, a placement of the stages; a schedule and a technique) in some
case; chosen greedily, as AETG does, by what each case newly covers for what it costs. The plan's own
checks (``ParallelPlan``), :func:`supports` (what a model cannot take) and :func:`known_bug` (what fails
for a bug this matrix found, not fixed yet) say what is not chosen.

Checkpoints come from the cases themselves: in each group of cases of one world size, model and
precision, the first resumes the one-device reference's checkpoint of the first epoch; every case that
trains the first epoch from scratch saves its checkpoint (alternately a consolidated file and a
distributed checkpoint), which the next case resumes at its own shape for the second epoch.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tiny_models import SequentialRegressor, regression_data, token_data
from tiny_tp_models import SplitQkvGPT, SplitQkvTinyGPT
from torch import nn

from lightning_parallel.layout.choices import SCHEDULES, V_SCHEDULES
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.contract import SearchOptions

# ----------------------------------------------------------------------------------------- models


class TiedFrozenMLP(SequentialRegressor):
    """The MLP of the matrix: five units (four Linear+Tanh blocks, a Linear head), AdamW with a learning
    rate halved every optimizer step (the scheduler must drive the optimizer a technique rebuilds); the
    head shares the first layer's weight (on another stage: two replicas of one weight) and the second
    block is frozen (a LoRA base: no gradient, no optimizer state, no host copy)."""

    def __init__(self) -> None:
        super().__init__(d_in=16, hidden=16, d_out=16, depth=5, adam=True)
        self.layers[-1].weight = self.layers[0][0].weight
        self.layers[1].requires_grad_(False)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class InPlaceGPT(SplitQkvGPT):
    """The Sequential GPT of the matrix (separate q, k, v: tensor parallelism splits it), its head with a
    bias: on a 3-D input the head returns a view, on which FSDP2 warns that an in-place op drops its
    pre-backward hook; the step writes into that view in place."""

    def __init__(self) -> None:
        super().__init__()
        head = self.layers[-1]
        self.layers[-1] = nn.Linear(head.in_features, head.out_features)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        logits.mul_(0.5)
        logits[..., 0] = -5.0
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss


@dataclass(frozen=True)
class Model:
    """A model of the matrix and its data: ``build()`` (seeded), the training and validation sets.

    ``units``: the units a split can put on stages (the blocks of a traced forward); ``loss``: its
    validation loss of ``(output, target)``; ``optimizer``: what its
    ``configure_optimizers`` makes (``"adamw"``, ``"sgd"``); ``tied``: its first and last unit share a
    weight; ``traced``: split from a traced forward (not a top-level ``nn.Sequential``);
    ``tensor_parallel``: its blocks split over tensor-parallel ranks; ``attention``: its attention is
    ``F.scaled_dot_product_attention`` (what sequence parallelism splits); ``predicts``: its predictions are
    compared (a GPT's argmax can tie); ``cost``: seconds of one rank's fit, relative to the MLP's (the
    traced forward is exported in each mode).
    """

    build: Callable[[], Any]
    data: Callable[[], Any]
    val: Callable[[], Any]
    units: int
    loss: Callable[[Any, Any, Any], torch.Tensor] = lambda out, y: F.cross_entropy(
        out.flatten(0, 1), y.flatten()
    )
    optimizer: str = "adamw"
    tied: bool = False
    traced: bool = False
    tensor_parallel: bool = False
    attention: bool = False
    predicts: bool = False
    cost: float = 1.0


SAMPLES, GLOBAL_BATCH, VAL_BATCH, MICROBATCHES = 44, 16, 16, 4
"""44 samples, a global batch of 16: three batches an epoch, the last short (12: 3 per replica of 4, which
4 micro-batches do not divide); two batches per optimizer step: a full and a partial window."""

MODELS = {
    "mlp": Model(TiedFrozenMLP, lambda: regression_data(SAMPLES, 16, 16),
                 lambda: regression_data(VAL_BATCH, 16, 16, seed=1), units=5, loss=F.mse_loss, tied=True,
                 predicts=True),
    "gpt": Model(InPlaceGPT, lambda: token_data(SAMPLES), lambda: token_data(VAL_BATCH, seed=1), units=5,
                 optimizer="sgd", tensor_parallel=True, attention=True, cost=3),
    "traced": Model(lambda: SplitQkvTinyGPT(depth=4), lambda: token_data(SAMPLES),
                    lambda: token_data(VAL_BATCH, seed=1), units=4, optimizer="sgd", tied=True, traced=True,
                    tensor_parallel=True, attention=True, cost=10),
}  # fmt: skip
TRAINER = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, val_check_interval=2, limit_val_batches=1,
               num_sanity_val_steps=0, log_every_n_steps=1)  # fmt: skip
"""Every case's Trainer (and the reference's): validation after the second batch, then training goes on."""

PRECISIONS = ("16-mixed",)
"""Precisions beside 32-true: 16-mixed with a GradScaler (its scale doubling every 2 clean steps)."""

# ------------------------------------------------------------------------------- shapes, variants

LOOPED = tuple(s for s in SCHEDULES if s not in V_SCHEDULES and s not in ("gpipe", "1f1b"))
PLACEMENTS = ("one stage", "looped", "V")


@dataclass(frozen=True)
class Shape:
    """The core of a case: the world size, the pipeline size and the schedule (``stages_per_rank`` 2 for
    the looped schedules; the V schedules imply it)."""

    world: int
    pipeline_size: int
    schedule: str = "1f1b"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule in LOOPED or self.schedule in V_SCHEDULES else 1

    @property
    def placement(self) -> str:
        """How the stages lie on the ranks: one per rank, looped (rank r holds r, r + p), or a V."""
        return "V" if self.schedule in V_SCHEDULES else "looped" if self.schedule in LOOPED else "one stage"

    def options(self) -> dict[str, Any]:
        looped = {"stages_per_rank": 2} if self.schedule in LOOPED else {}
        return {"pipeline_size": self.pipeline_size, "schedule": self.schedule, **looped}

    def __str__(self) -> str:
        return f"{self.world} ranks, pp {self.pipeline_size} {self.schedule}"


SHAPES = (
    *(Shape(2, 2, s) for s in SCHEDULES),  # every schedule on two pipeline ranks
    Shape(2, 1),
    *(Shape(2, 1, s) for s in LOOPED),  # two stages on one rank, two replicas (issue 51 item 8)
    *(Shape(4, 2, s) for s in SCHEDULES),  # every schedule, two pipeline ranks of two replicas
    Shape(4, 1),
    Shape(4, 4),
)


CALLS: list[tuple[str, tuple[int, ...]]] = []
"""What :func:`mark_stage` was called with in this process (``matrix_checks.UserFunction`` reads it)."""


def mark_stage(stage: nn.Module, mesh: Any) -> None:
    """The matrix's ``parallelize_fn``: leaves the numbers alone, notes the stage and the mesh it got."""
    CALLS.append((type(stage).__name__, tuple(mesh.shape)))


OFFLOAD_DIR = "<out>/offload"
"""The disk tier's ``offload_dir`` in a case's options: the runner puts it under its job's directory
(:func:`resolved`), which the search's own variant (given a directory) cannot know."""


def resolved(options: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """A case's options as a job runs them: :data:`OFFLOAD_DIR` made under ``out_dir`` (on every rank)."""
    if options.get("offload_dir") != OFFLOAD_DIR:
        return options
    directory = os.path.join(out_dir, "offload")
    os.makedirs(directory, exist_ok=True)
    return {**options, "offload_dir": directory}


NOT_SEARCHED: dict[str, tuple[dict[str, Any], ...]] = {
    "recompute": (),
    "tensor_parallel": ({"tensor_parallel_size": 2},),
    "user_function": ({"parallelize_fn": mark_stage},),
    "compile": ({"compile": {"backend": "eager"}},),  # (dynamo without a compiler: test_pipeline_compile's)
    "fsdp": ({"data_parallel": "fsdp", "data_parallel_shard_size": 2},),  # HSDP
    "zero": (),
    "replicas": (),  # (data_parallel="replicate" with replicas: the default)
    "overlap": ({"overlap_gradient_reduction": False},),  # (on, the default: every case with replicas)
    "offload": (
        {"offload": ("optimizer", "activations")},
        {"offload": ("parameters", "activations")},
        {"offload": ("optimizer",), "offload_to": "disk", "offload_dir": OFFLOAD_DIR},  # (the disk tier)
    ),
    "sequence_parallel": ({"sequence_parallel_size": 2},),  # (searched where a model's heads are known)
    "causal_attention": (),  # (no field: ALWAYS_ON)
}
"""Per technique (every one of ``TECHNIQUES``, by name), the variants its ``variants()`` does not yield."""

ALWAYS_ON = ("causal_attention",)
"""Techniques without a plan field: nothing for a case to choose, so no case is said to run them; their
own tests check them (tests/test_causal_attention.py; the Hugging Face tests, whose traced decoders
hand it their causal masks: none of the matrix's models passes its attention a mask)."""

EXPENSIVE = ("compile",)
"""Techniques whose variants run once, in no required pair (each compiles its stages)."""

ALONE = (*EXPENSIVE, "overlap")
"""Techniques whose variants run in no required pair: the :data:`EXPENSIVE` ones, and the overlapped
reduction's off switch (the same buckets reduced after the schedule; on, its default, runs in every case
with replicas and is checked there: ``matrix_checks.Overlap``)."""

SOURCE_SENSITIVE = ("recompute", "tensor_parallel", "fsdp")
"""Techniques written for each stage source apart (the traced path: units wrapped as a stage is
prepared, a graph on DTensors, one FSDP2 root per stage): each model is paired with each of their
variants."""

GRADIENTS_ELSEWHERE = ("tensor_parallel", "fsdp", "zero", "offload")
"""Techniques whose gradients or optimizer state are split, sharded or on the host, where a GradScaler
must find an overflow on every rank: a precision is paired with each of their variants."""


def _key(options: dict[str, Any]) -> str:
    """A variant's name: its options (``offload=optimizer,activations``)."""

    def shown(value: Any) -> str:
        if callable(value):
            return value.__name__
        if isinstance(value, dict):
            return ",".join(f"{k}:{v}" for k, v in value.items())
        return ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)

    return " ".join(f"{k}={shown(v)}" for k, v in options.items())


@functools.cache
def variants() -> dict[str, dict[str, dict[str, Any]]]:
    """Per technique, its variants by name: what its ``variants()`` yields on the matrix's shapes (as the
    planner's search asks, a split ``nn.Sequential``), then :data:`NOT_SEARCHED`."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    search = SearchOptions(layout="sequential")
    for technique in TECHNIQUES:
        mine = found.setdefault(technique.name, {})
        for shape in SHAPES:
            plan = ParallelPlan(devices=shape.world, num_microbatches=MICROBATCHES, **shape.options())
            for options in technique.variants(plan, search):
                if options:
                    mine.setdefault(_key(options), dict(options))
        for options in NOT_SEARCHED[technique.name]:
            mine.setdefault(_key(options), dict(options))
    return found


# ------------------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    """One configuration: what ``test_matrix.py`` trains on ``shape.world`` ranks against one device.

    ``chosen``: the technique variants by technique name; ``resumes``: ``"reference"`` (the one-device
    run's first-epoch checkpoint), the name of the case whose checkpoint it resumes for the second epoch,
    or None (it trains the first epoch from scratch); ``saves``: ``"file"``, ``"dcp"`` or None.
    """

    name: str
    shape: Shape
    model: str
    precision: str
    chosen: dict[str, str]
    options: dict[str, Any]
    resumes: str | None = None
    saves: str | None = None
    cost: float = 0.0
    plan: Any = field(default=None, compare=False)

    @property
    def epochs(self) -> int:
        return 1 if self.resumes is None else 2

    def active(self) -> list[str]:
        """The techniques this case runs (a variant chosen, or the replicas' all-reduce)."""
        replicas = self.plan.data_parallel_size > 1 and self.plan.data_parallel in ("replicate", "zero1")
        by_default = ("replicas", "overlap")  # (the replicas' all-reduce, overlapped unless switched off)
        return [t.name for t in TECHNIQUES if t.name in self.chosen or (t.name in by_default and replicas)]


def supports(model: str, shape: Shape, options: dict[str, Any]) -> bool:
    """What the model can take beyond the plan's own checks (the plan is checked without a model)."""
    spec = MODELS[model]
    if options.get("tensor_parallel_size", 1) > 1 and not spec.tensor_parallel:
        return False
    if options.get("sequence_parallel_size", 1) > 1 and not spec.attention:
        return False  # refused: no scaled_dot_product_attention to split the sequence around
    if shape.pipeline_size * shape.stages_per_rank > spec.units:
        return False
    if spec.traced and options.get("parallelize_fn"):  # refused: a traced stage has no modules to give
        return False
    if spec.traced and shape.pipeline_size == 1 and shape.stages_per_rank > 1:
        return False  # refused: several traced stages on the only pipeline rank
    if _tied_on_one_rank(model, shape) and options.get("data_parallel") == "fsdp":
        return False  # refused: FSDP2 cannot shard one weight in two stages of one rank
    # refused: one FSDP root per traced stage, several stages per rank
    return not (spec.traced and options.get("data_parallel") == "fsdp" and shape.stages_per_rank > 1)


def _sensible(shape: Shape, options: dict[str, Any]) -> bool:
    """Sharding over the replicas needs replicas (as the search asks: the plan accepts one), and HSDP
    replicas of the shards (the plan accepts a shard size of all the data-parallel ranks: FSDP2); the
    overlapped reduction's off switch needs the replicas' all-reduce it switches (FSDP2's is its own)."""
    across = options.get("tensor_parallel_size", 1) * options.get("sequence_parallel_size", 1)
    replicas = shape.world // (shape.pipeline_size * across)
    if options.get("overlap_gradient_reduction") is False and (
        replicas == 1 or options.get("data_parallel") == "fsdp"
    ):
        return False
    if options.get("data_parallel_shard_size", replicas) >= replicas > 1:
        return options.get("data_parallel_shard_size") is None
    return replicas > 1 or options.get("data_parallel", "replicate") == "replicate"


def known_bug(model: str, shape: Shape, options: dict[str, Any]) -> str | None:
    """Why a case would fail for a bug this matrix found and that is not fixed yet (it is not generated;
    delete the rule once fixed), or None.

    Tensor parallelism on a traced forward under a V or zero-bubble schedule (backward split in two):
    the first step fails in ``Optimizer.zero_grad`` ("Can't detach views in-place"), and the
    strategy's teardown then in ``LightningModule.cpu()`` ("_apply(): Couldn't swap Linear.weight").
    """
    split_backward = shape.placement == "V" or "zero_bubble" in shape.schedule  # (stage_backward_input)
    if MODELS[model].traced and options.get("tensor_parallel_size", 1) > 1 and split_backward:
        return "tensor parallelism on a traced forward under a V schedule: zero_grad fails on views"
    return None


def _tied_on_one_rank(model: str, shape: Shape) -> bool:
    """The model's tied first and last unit on two stages of one rank (V, or every stage on one rank)."""
    one_rank = shape.schedule in V_SCHEDULES or (shape.pipeline_size == 1 and shape.stages_per_rank > 1)
    return MODELS[model].tied and one_rank


def resume_fails(saved: dict[str, Any], options: dict[str, Any]) -> str | None:
    """Why a case cannot resume a checkpoint another case saved (a bug this matrix found), or None.

    None known: ZeRO-1's AdamW and a plain one resumed each other's state once a checkpoint named the
    optimizer that steps (``pipeline/state.py: optimizer_type``), not ZeRO-1's wrapper.
    """
    return None


def _merged(shape: Shape, chosen: dict[str, str]) -> dict[str, Any] | None:
    """The strategy options of a shape and chosen variants, None where two variants set one option apart."""
    options = shape.options()
    table = variants()
    for technique, name in chosen.items():
        for key, value in table[technique][name].items():
            if key in options and options[key] != value:
                return None
            options[key] = value
    return options


@functools.cache
def _plan(world: int, items: tuple[tuple[str, str], ...]) -> ParallelPlan | None:
    """The plan of a shape's and the variants' options (``items``: their reprs, for the cache), or None."""
    try:
        return ParallelPlan(devices=world, num_microbatches=MICROBATCHES, **_OPTIONS[items])
    except (ValueError, TypeError):
        return None


_OPTIONS: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}


def _accepted(shape: Shape, model: str | None, chosen: dict[str, str]) -> ParallelPlan | None:
    """The case's plan (``model`` None: the plan's own checks only), or None where it is refused."""
    options = _merged(shape, chosen)
    if options is None or (model is not None and not supports(model, shape, options)):
        return None
    items = tuple(sorted((k, repr(v)) for k, v in options.items()))
    _OPTIONS.setdefault(items, options)
    return _plan(shape.world, items)


def _cost(shape: Shape, model: str, chosen: dict[str, str]) -> float:
    per_rank = MODELS[model].cost * (2 if "tensor_parallel" in chosen else 1)
    return shape.world * per_rank * (3 if any(t in chosen for t in EXPENSIVE) else 1)


Item = tuple[str, str]  # (factor, value): ("shape", "4 ranks, pp 2 zbv"), ("offload", "offload=optimizer")


def covers(shape: Shape, model: str, precision: str, chosen: dict[str, str], requirement: frozenset) -> bool:
    """Whether a case meets a requirement. A case at another precision than 32-true meets only those
    that name its precision: it comes close to one device, not equal, so it checks nothing else."""
    if precision != "32-true" and all(factor != "precision" for factor, _ in requirement):
        return False
    return requirement <= _items(shape, model, precision, chosen)


def _items(shape: Shape, model: str, precision: str, chosen: dict[str, str]) -> set[Item]:
    items = {
        ("shape", str(shape)),
        ("schedule", shape.schedule),
        ("placement", shape.placement),
        ("model", model),
    }
    items |= {("precision", precision)} if precision != "32-true" else set()
    return items | set(chosen.items()) | {("technique", t) for t in chosen}


def requirements() -> list[frozenset[Item]]:
    """What the cases must cover together: every shape, model, precision and variant; every pair of two
    variants (of two techniques, or a variant and a precision); every model with each of
    :data:`PLACEMENTS`, each technique (some variant of it) and each variant of :data:`SOURCE_SENSITIVE`;
    and every schedule with each technique (tensor parallelism, which needs a GPT: each placement). The
    :data:`ALONE` techniques are in no pair; a precision is paired with each technique, and with each
    variant of :data:`GRADIENTS_ELSEWHERE` (its cases come close to one device, not equal: few of them)."""
    table = variants()
    chosen = [(t, name) for t, names in table.items() for name in names]
    precisions = [("precision", p) for p in PRECISIONS]
    single = [("shape", str(s)) for s in SHAPES] + [("model", m) for m in MODELS] + chosen + precisions
    paired = [c for c in chosen if c[0] not in ALONE]
    techniques = sorted({t for t, _ in paired})
    pairs = [(a, b) for a, b in itertools.combinations(paired, 2) if a[0] != b[0]]
    pairs += [(p, ("technique", t)) for p in precisions for t in techniques]
    pairs += [(p, c) for p in precisions for c in paired if c[0] in GRADIENTS_ELSEWHERE]
    pairs += [(("model", m), ("technique", t)) for m in MODELS for t in techniques]
    pairs += [(("model", m), c) for m in MODELS for c in paired if c[0] in SOURCE_SENSITIVE]
    pairs += [(("model", m), ("placement", p)) for m in MODELS for p in PLACEMENTS]
    pairs += [
        (("schedule", s), ("technique", t)) for s in SCHEDULES for t in techniques if t != "tensor_parallel"
    ]
    pairs += [(("placement", p), ("technique", "tensor_parallel")) for p in PLACEMENTS]
    return [frozenset([i]) for i in single] + [frozenset(p) for p in pairs]


def _factors() -> list[tuple[str, list[Any]]]:
    """The factors a case picks a value of, in this order: the shape, the model, the precision, then one
    variant or none (``None``) of each technique in the list's order."""
    table = variants()
    factors: list[tuple[str, list[Any]]] = [("shape", list(SHAPES)), ("model", list(MODELS))]
    factors.append(("precision", ["32-true", *PRECISIONS]))
    return factors + [(t.name, [None, *table[t.name]]) for t in TECHNIQUES if table[t.name]]


def _build(seed: frozenset[Item], uncovered: set[frozenset[Item]]) -> tuple | None:
    """The case grown from ``seed``: each factor in turn takes the value that covers the most uncovered
    requirements for its cost with what is chosen so far (the cheaper on a tie), keeping the plan
    accepted with the seed's own values."""
    fixed = dict(seed)
    picked = {f: v for f, v in fixed.items() if f not in ("shape", "schedule", "placement", "technique")}
    if "precision" not in fixed and fixed.get("technique") != "precision":
        picked["precision"] = "32-true"  # (a case at another precision meets only the precision's pairs)
    for factor, values in _factors():
        if factor in picked:
            continue
        if factor == "shape":
            values = [s for s in values if str(s) == fixed.get("shape", str(s))]
            values = [s for s in values if s.schedule == fixed.get("schedule", s.schedule)]
            values = [s for s in values if s.placement == fixed.get("placement", s.placement)]
        elif factor == fixed.get("technique"):
            values = [v for v in values if v not in (None, "32-true")]
        best = None
        for value in values:
            state = _state({**picked, factor: value})
            decided = {*picked, factor}
            if state is None or not _completable(state, "model" in decided, fixed, decided):
                continue
            gain = sum(covers(*state, r) for r in uncovered)
            score = (gain / _cost(state[0], state[1], state[3]), -_cost(state[0], state[1], state[3]))
            if best is None or score > best[0]:
                best = (score, value)
        if best is None:
            return None
        picked[factor] = best[1]
    state = _state(picked)
    return state if _valid(*state, model_known=True) and covers(*state, seed) else None


def _completable(state: tuple, model_known: bool, fixed: dict[str, str], decided: set[str]) -> bool:
    """Whether the partial case is accepted, or is once one more technique not ``decided`` yet gets a
    variant (offload of the parameters needs FSDP2, later in the list); with a variant of the seed's
    technique."""
    shape, model, precision, chosen = state
    table = variants()
    needed = fixed.get("technique")
    if needed == "precision":
        needed = None if precision != "32-true" or "precision" not in decided else ""
        if needed == "":
            return False
    if needed is not None and needed not in chosen:
        if needed in decided:
            return False
        return any(
            _completable(
                (shape, model, precision, {**chosen, needed: name}), model_known, {}, decided | {needed}
            )
            for name in table[needed]
        )
    models = [model] if model_known else list(MODELS)  # (the shape comes first: some model must fit)
    if any(_valid(shape, m, precision, chosen, model_known=True) for m in models):
        return True
    return any(
        _valid(shape, m, precision, {**chosen, t: name}, model_known=True)
        for m in models
        for t in table
        if t not in decided
        for name in table[t]
    )


def _valid(shape: Shape, model: str, precision: str, chosen: dict[str, str], model_known: bool) -> bool:
    options = _merged(shape, chosen)
    if options is None or not _sensible(shape, options):
        return False
    if model_known and (not supports(model, shape, options) or known_bug(model, shape, options)):
        return False
    return _accepted(shape, model if model_known else None, chosen) is not None


def _state(picked: dict[str, Any]) -> tuple[Shape, str, str, dict[str, str]] | None:
    shape = picked.get("shape")
    if shape is None:
        return None
    model = picked.get("model", "mlp")
    precision = picked.get("precision") or "32-true"
    chosen = {k: v for k, v in picked.items() if k not in ("shape", "model", "precision") and v is not None}
    return shape, model, precision, chosen


@functools.cache
def _generated() -> tuple[list[tuple], list[frozenset[Item]]]:
    """The greedy cover of :func:`requirements`, and the requirements no accepted case can meet."""
    uncovered = set(requirements())
    order = sorted(uncovered, key=lambda r: (-len(r), sorted(r)))  # pairs first, then the rest
    built, infeasible = [], []
    while uncovered:
        seeds = [r for r in order if r in uncovered][:4]
        found = []
        for seed in seeds:
            case = _build(seed, uncovered)
            if case is None:
                uncovered.discard(seed)
                infeasible.append(seed)
                continue
            covered = {r for r in uncovered if covers(*case, r)}
            found.append((len(covered) / _cost(case[0], case[1], case[3]), covered, case))
        if found:
            _, covered, case = max(found, key=lambda f: f[0])
            uncovered -= covered
            built.append(case)
    # (a seed the greedy growth could not meet, that a later case met after all)
    infeasible = [r for r in infeasible if not any(covers(*case, r) for case in built)]
    return built, infeasible


def _name(shape: Shape, model: str, precision: str, plan: ParallelPlan) -> str:
    extra = f" {precision}" if precision != "32-true" else ""
    return f"{model} {plan.label()}{extra}"


@functools.cache
def all_cases() -> tuple[Case, ...]:
    """Every case of the matrix, by world size then in the order they were chosen."""
    built, _ = _generated()
    cases: list[Case] = []
    for world in sorted({s.world for s in SHAPES}):
        groups: dict[tuple[str, str], list[tuple]] = {}
        for shape, model, precision, chosen in built:
            if shape.world == world:
                groups.setdefault((model, precision), []).append((shape, model, precision, chosen))
        for group in groups.values():
            cases += _with_checkpoints(group)
    return tuple(cases)


def _with_checkpoints(group: list[tuple]) -> Iterator[Case]:
    """The cases of one world size, model and precision: the first resumes the one-device reference's
    checkpoint; each of the others resumes the case before it when that case trained from scratch and
    can be resumed (not :func:`resume_fails`), else it trains from scratch; every case that trains from
    scratch saves its checkpoint (a file, then a distributed checkpoint, in turn; the test resumes each
    on one device too)."""
    formats = itertools.cycle(("file", "dcp"))
    previous: Case | None = None
    for i, (shape, model, precision, chosen) in enumerate(group):
        options, resumes, saves = dict(_merged(shape, chosen)), None, None
        if i == 0:
            resumes = "reference"
        elif previous is not None and previous.saves and resume_fails(previous.options, options) is None:
            resumes = previous.name
        else:
            saves = next(formats)
            if saves == "dcp":
                options["save_distributed_checkpoint"] = True
        plan, cost = _accepted(shape, model, chosen), _cost(shape, model, chosen)
        name = _name(shape, model, precision, plan)
        previous = Case(name, shape, model, precision, chosen, options, resumes, saves, cost, plan)
        yield previous


def cases(world: int) -> list[Case]:
    """The cases of one world size (one spawned job)."""
    return [c for c in all_cases() if c.shape.world == world]


def infeasible() -> list[frozenset[Item]]:
    """The requirements no accepted case can meet (two variants the plan refuses together, ...)."""
    return _generated()[1]


def precision_plugins(precision: str) -> dict[str, Any]:
    """The Trainer options of a precision (16-mixed: a GradScaler whose scale moves within the run)."""
    if precision != "16-mixed":
        return {"precision": precision}
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
