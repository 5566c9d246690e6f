"""Measure the activations of each pipeline unit from forward passes on a small slice of the batch.

Autograd's saved-tensor hooks see every tensor a forward keeps for backward; each is charged to the
unit whose forward is running (forward hooks), once per storage, parameters excluded. Two probe
sizes give a straight line ``bytes = a + b x samples`` per unit, which scales to the real
micro-batch. Both probes run inside one autocast region (mixed precision): a tensor saved by both
is autocast's cached copy of a weight, kept once per step, not once per micro-batch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_parallel.planner.units import UnitLayout
from lightning_parallel.sources.fake_device import FakeDevice, faked_on

StepFn = Callable[[nn.Module, Any], Any]
BEFORE = "<before>"  # saved before any unit runs (charged to the first stage)
_AFTER = "<after>"  # suffix: saved outside any unit after this one returned (the loss, ...)


@dataclass(frozen=True)
class Line:
    """Bytes as a function of samples: ``intercept + slope x samples``."""

    intercept: float = 0.0
    slope: float = 0.0

    def at(self, samples: float) -> int:
        return max(0, round(self.intercept + self.slope * samples))


@dataclass
class UnitActivations:
    """Per unit: bytes saved for backward, its inputs and outputs, its largest saved tensor.

    ``after`` is what the code between this unit and the next saves (a residual add, the loss):
    it stays with this unit's stage and is never recomputed.
    """

    saved: Line = field(default_factory=Line)
    after: Line = field(default_factory=Line)
    inputs: Line = field(default_factory=Line)
    outputs: Line = field(default_factory=Line)
    largest: Line = field(default_factory=Line)
    saved_input: Line = field(default_factory=Line)  # of ``saved``: the unit's own inputs
    saved_output: Line = field(default_factory=Line)  # of ``saved``: the unit's own outputs
    weight_copies: int = 0  # autocast's cached low-precision weights: once per step


@dataclass
class Probe:
    """What the probe forwards measured, by unit name (:data:`BEFORE`: before any unit ran)."""

    units: dict[str, UnitActivations]
    first_call: dict[str, int]
    sizes: tuple[int, ...]

    def unit(self, name: str) -> UnitActivations:
        return self.units.get(name, UnitActivations())


def default_step(module: nn.Module, batch: Any) -> Any:
    """One training forward: ``training_step(batch, 0)`` when the module has one, else ``module(batch)``.

    Example::

        loss = default_step(lightning_module, (x, y))
    """
    step = getattr(module, "training_step", None)
    if callable(step):
        return step(batch, 0)
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def probe_activations(
    module: nn.Module,
    layout: UnitLayout,
    batch: Any,
    sizes: tuple[int, ...],
    autocast_dtype: torch.dtype | None = None,
    step: StepFn = default_step,
    device: torch.device | str | None = None,
) -> Probe:
    """Run ``step`` on the first ``n`` samples of ``batch`` for each ``n`` in ``sizes``; fit lines.

    A module on the meta device is run on fake tensors of ``device`` (default: this machine's
    accelerator, else the CPU; see :mod:`~lightning_parallel.sources.fake_device`): nothing is
    allocated, and the forward takes that device's path (its attention kernel, its autocast).

    Raises:
        ValueError: the module rejects the batch (the message carries the module's own error).

    Example::

        probe = probe_activations(model, find_units(model), (x, y), sizes=(2, 4))
        probe.unit("layers.1").saved.at(8)     # bytes layer 1 saves for a micro-batch of 8
    """
    records, order = [], {}
    with _on_device(module, device) as (device, fake), _preserved(module), _autocast(device, autocast_dtype):
        for n in sizes:
            recorder = _Recorder(module, layout)
            inputs = _slice(batch, n, device) if fake is None else fake.inputs(_first(batch, n))
            with recorder.hooks(), fake.mode if fake is not None else contextlib.nullcontext():
                _run(step, module, inputs)
            records.append(recorder)
            order = order or recorder.first_call
    return Probe(_fit(records, sizes), order, sizes)


@contextlib.contextmanager
def _on_device(module: nn.Module, device: Any) -> Iterator[tuple[torch.device, FakeDevice | None]]:
    """The device the probe runs on, and the fakes of a meta module's tensors there (else ``None``)."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        yield next((p.device for p in module.parameters()), torch.device("cpu")), None
        return
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    with faked_on(module, device if device is not None else accelerator) as fake:
        yield fake.device, fake


class _Recorder:
    """Charges each saved storage to the running unit; records unit inputs and outputs."""

    def __init__(self, module: nn.Module, layout: UnitLayout) -> None:
        self.layout = layout
        self.params = {p.untyped_storage()._cdata for p in module.parameters() if not p.is_meta}
        self.owner: dict[int, str] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}  # keeps them alive: keys stay unique
        self.saved: dict[str, int] = {}
        self.largest: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.charged: dict[str, set[int]] = {}
        self.input_keys: dict[str, set[int]] = {}
        self.output_keys: dict[str, set[int]] = {}
        self.first_call: dict[str, int] = {}
        self.stack: list[str] = []
        self.last = ""
        self.keep: list[Any] = []

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.params or key in self.owner:
            return t
        where = self.stack[-1] if self.stack else (self.last + _AFTER if self.last else BEFORE)
        self.owner[key], self.storages[key] = where, storage
        nbytes = storage.nbytes()
        self.saved[where] = self.saved.get(where, 0) + nbytes
        self.charged.setdefault(where, set()).add(key)
        self.largest[where] = max(self.largest.get(where, 0), nbytes)
        return t

    def charged_bytes(self, name: str, keys: dict[str, set[int]]) -> int:
        both = self.charged.get(name, set()) & keys.get(name, set())
        return sum(self.storages[k].nbytes() for k in both)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        for unit in self.layout.units:
            handles.append(unit.module.register_forward_pre_hook(self._enter(unit.name), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(self._leave(unit.name), always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.stack:
                self.first_call.setdefault(name, len(self.first_call))
                self.inputs.setdefault(name, _nbytes((args, kwargs)))
                self.input_keys.setdefault(name, _keys((args, kwargs)))
                self.keep.append((args, kwargs))  # alive until the end: storage keys stay unique
            self.stack.append(name)

        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self.stack.pop()
            if not self.stack:
                self.outputs.setdefault(name, _nbytes(output))
                self.output_keys.setdefault(name, _keys(output))
                self.keep.append(output)
                self.last = name

        return hook


def _fit(records: list[_Recorder], sizes: tuple[int, ...]) -> dict[str, UnitActivations]:
    # Storages saved by every probe run are the same tensors each time: autocast's weight cache.
    shared = set.intersection(*(set(r.storages) for r in records)) if len(records) > 1 else set()
    names = {n.removesuffix(_AFTER) for r in records for n in r.saved.keys() | r.inputs.keys()}
    out = {}
    for name in names:
        copies = sum(records[0].storages[k].nbytes() for k in shared if records[0].owner[k] == name)
        per_run = [r.saved.get(name, 0) - copies for r in records]
        after = [r.saved.get(name + _AFTER, 0) for r in records]
        out[name] = UnitActivations(
            saved=_line(sizes, per_run),
            after=_line(sizes, after),
            inputs=_line(sizes, [r.inputs.get(name, 0) for r in records]),
            outputs=_line(sizes, [r.outputs.get(name, 0) for r in records]),
            largest=_line(sizes, [r.largest.get(name, 0) for r in records]),
            saved_input=_line(sizes, [r.charged_bytes(name, r.input_keys) for r in records]),
            saved_output=_line(sizes, [r.charged_bytes(name, r.output_keys) for r in records]),
            weight_copies=copies,
        )
    return out


def _line(sizes: tuple[int, ...], values: list[int]) -> Line:
    if len(sizes) == 1 or sizes[0] == sizes[-1]:
        return Line(0.0, values[0] / sizes[0])
    slope = (values[-1] - values[0]) / (sizes[-1] - sizes[0])
    return Line(values[0] - slope * sizes[0], slope)


def _run(step: StepFn, module: nn.Module, batch: Any) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer, and the like
            step(module, batch)
    except Exception as err:
        shapes = [tuple(t.shape) for t in tree_leaves(batch) if torch.is_tensor(t)]
        raise ValueError(
            f"{type(module).__name__} rejected the batch (tensor shapes {shapes} after slicing to a few "
            f"samples): {type(err).__name__}: {err}. Pass one training batch as the model's training_step "
            f"(or forward) takes it"
        ) from err


def _slice(batch: Any, n: int, device: torch.device) -> Any:
    def one(x: Any) -> Any:
        if torch.is_tensor(x) and x.dim() > 0:
            # A copy, not a view: a view would share the batch's storage between the probe runs.
            return x[:n].to(device, copy=True)
        return x

    return tree_map(one, batch)


def _first(batch: Any, n: int) -> Any:
    return tree_map(lambda x: x[:n] if torch.is_tensor(x) and x.dim() > 0 else x, batch)


def _nbytes(tree: Any) -> int:
    seen = {}
    for t in tree_leaves(tree):
        if torch.is_tensor(t):
            seen[t.untyped_storage()._cdata] = t.numel() * t.element_size()
    return sum(seen.values())


def _keys(tree: Any) -> set[int]:
    return {t.untyped_storage()._cdata for t in tree_leaves(tree) if torch.is_tensor(t)}


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None or device.type == "meta":
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


@contextlib.contextmanager
def _preserved(module: nn.Module) -> Iterator[None]:
    """The probe must not change the model: buffers (BatchNorm statistics), RNG and train mode stay."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    was_training = module.training
    module.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            yield
    finally:
        module.train(was_training)
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def probe_sizes(samples: int) -> tuple[int, ...]:
    """Two small probe sizes (or one, for a tiny batch): the batch is sliced to them.

    Example::

        >>> probe_sizes(32)
        (2, 4)
    """
    return tuple(sorted({min(2, samples), min(4, samples)}))
