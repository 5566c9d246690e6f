"""The planner's facts at any sequence length, from the model measured at a few short ones.

The planner measures a model on one batch: its activation bytes and unit times are lines in the samples
of a micro-batch at that batch's sequence length ``T``. Asking "what length fits?" needs them at every
length, and measuring at 32768 tokens is what the question is meant to avoid. So the model is measured
at three short lengths (``T/4``, ``T/2``, ``T`` of a reference ``T``, :func:`probe_lengths`) and:

* **bytes** (every line of the memory probe: what a unit saves, its inputs, outputs, transients, ...)
  are fitted exactly as ``c0 + c1 t + c2 t^2`` in the length ``t``, intercept and slope alike, and
  evaluated at the length asked. Per-token tensors are the linear term; an attention that keeps its
  ``(b, heads, t, t)`` weights (an eager attention, a Hugging Face ``(b, 1, t, t)`` mask) the quadratic
  one; SDPA's fused kernels keep ``O(t)``. The probe counts tensor bytes, which are exact polynomials of
  the length for these, so three lengths determine them (tests compare against a direct measurement).
* **time** is measured once, at the reference length, and scaled by the work per sample (timings at
  short lengths are too noisy to fit a quadratic from): a unit's slope (seconds per sample) times
  ``t/T`` for its token-wise work, and, for a unit holding attentions, its per-token work counted as
  ``2 P + 4 t d`` multiply-adds per attention (``P``: its matmul parameters, embeddings left out;
  ``d``: its hidden width, read from its output's bytes; the ``Q K^T`` and ``A V`` products as a full
  square, Kaplan et al.'s ``2N + 2 n_layer n_ctx d`` forward count), so that share grows with ``t``.
  The intercept (what a call costs whatever its size) is kept.

Everything else (parameters, gradients, optimizer state, the optimizer step's time) does not depend on
the length and is the reference measurement's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.planner.facts import ModelFacts, measure_model
from lightning_parallel.planner.precision import PRECISION_DTYPES
from lightning_parallel.planner.probe import Line, Probe, StepFn, UnitActivations, default_step
from lightning_parallel.planner.ranking import measure_for
from lightning_parallel.planner.search import Search
from lightning_parallel.planner.time_probe import AFTER, TimeFacts, TimeLine, UnitTime
from lightning_parallel.techniques.sequence_parallel import planned

REFERENCE = 512
"""The longest length the model is measured (and timed) at: short enough to be cheap anywhere."""

_LINES = tuple(f.name for f in dataclasses.fields(UnitActivations) if f.type in ("Line", Line))


def probe_lengths(upper: int, multiple: int = 1, reference: int = REFERENCE) -> tuple[int, ...]:
    """The lengths the model is measured at: a reference (at most ``upper`` and :data:`REFERENCE`), its
    half and its quarter, each a multiple of ``multiple`` (fewer where they coincide).

    Example::

        >>> probe_lengths(32768, 4)
        (128, 256, 512)
        >>> probe_lengths(48, 8)
        (8, 24, 48)
    """
    top = max(multiple, min(upper, reference) // multiple * multiple)
    found = {max(multiple, top // d // multiple * multiple) for d in (4, 2, 1)}
    return tuple(sorted(found))


@dataclass
class LengthFacts:
    """The model measured at a few lengths; :meth:`at` gives the planner's facts at any length.

    Example::

        scaled = measure_lengths(model, lambda t: (x[:, :t], y[:, :t]), search, upper=32768)
        facts = scaled.at(16384)                # {tensor-parallel size: ModelFacts} at 16384 tokens
        plan_search(facts, search, links)
    """

    facts: dict[int, ModelFacts]  # by tensor-parallel size, measured (and timed) at ``lengths[-1]``
    probes: dict[int, list[Probe]]  # by tensor-parallel size: the memory probe at each of ``lengths``
    lengths: tuple[int, ...]

    @property
    def reference(self) -> int:
        return self.lengths[-1]

    def at(self, tokens: int) -> dict[int, ModelFacts]:
        """The facts at ``tokens`` a sample: bytes from the fitted polynomials, times scaled."""
        if tokens < 1:
            raise ValueError(f"a sequence length must be positive, got {tokens}")
        return {tp: self._one(tp, tokens) for tp in self.facts}

    def _one(self, tp: int, tokens: int) -> ModelFacts:
        base = self.facts[tp]
        probe = _probe_at(self.probes[tp], self.lengths, tokens)
        times = None if base.times is None else _times_at(base, self.reference, tokens)
        return dataclasses.replace(base, probe=probe, times=times, tokens=tokens)


def measure_lengths(
    module: nn.Module,
    batch_at: Callable[[int], Any],
    search: Search,
    upper: int,
    optimizer: Any = None,
    step: StepFn = default_step,
    multiple: int = 1,
) -> LengthFacts:
    """Measure ``module`` at :func:`probe_lengths` of ``upper`` (``batch_at(t)``: a batch of ``t``
    tokens a sample, holding at least the search's largest micro-batch), timed at the longest of them, at
    each of the search's tensor-parallel sizes.

    Raises:
        ValueError: what :func:`~lightning_parallel.planner.facts.measure_model` raises.
    """
    lengths = probe_lengths(upper, multiple)
    facts = measure_for(module, batch_at(lengths[-1]), search, optimizer, step)
    probes = {tp: [] for tp in facts}
    for t in lengths[:-1]:
        batch = batch_at(t)
        for tp in facts:
            measured = measure_model(module, batch, search.precision, optimizer, step, tp)
            probes[tp].append(measured.probe)
    for tp, f in facts.items():
        probes[tp].append(f.probe)
    return LengthFacts(facts, probes, lengths)


def _probe_at(probes: list[Probe], lengths: tuple[int, ...], tokens: int) -> Probe:
    names = dict.fromkeys(n for p in probes for n in p.units)
    units = {}
    for name in names:
        found = [p.unit(name) for p in probes]
        lines = {
            f: Line(_poly([getattr(u, f).intercept for u in found], lengths, tokens),
                    _poly([getattr(u, f).slope for u in found], lengths, tokens))
            for f in _LINES
        }  # fmt: skip
        units[name] = dataclasses.replace(found[-1], **lines)
    return dataclasses.replace(probes[-1], units=units)


def _poly(values: list[float], lengths: tuple[int, ...], t: float) -> float:
    """The polynomial through ``(lengths[i], values[i])`` (degree ``len - 1``, Lagrange's form) at ``t``."""
    out = 0.0
    for i, (xi, yi) in enumerate(zip(lengths, values)):
        term = float(yi)
        for j, xj in enumerate(lengths):
            if j != i:
                term *= (t - xj) / (xi - xj)
        out += term
    return out


def _times_at(facts: ModelFacts, reference: int, tokens: int) -> TimeFacts:
    times = facts.times
    assert times is not None
    growth = _work_growth(facts, reference, tokens)
    units = {}
    for name, ut in times.units.items():
        g = tokens / reference if name.endswith(AFTER) else growth.get(name, tokens / reference)
        units[name] = UnitTime(_scaled(ut.forward, g), _scaled(ut.backward, g))
    return dataclasses.replace(times, units=units)


def _scaled(line: TimeLine, factor: float) -> TimeLine:
    return TimeLine(line.intercept, line.slope * factor)


def _work_growth(facts: ModelFacts, reference: int, tokens: int) -> dict[str, float]:
    """Per unit holding attentions: its work per sample at ``tokens`` over that at ``reference``."""
    dtype = PRECISION_DTYPES[facts.precision][0] or torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    out = {}
    for u in facts.layout.units:
        found = planned.attentions(u.module)
        if not found:
            continue
        width = facts.probe.unit(u.name).outputs.slope / (reference * elem)  # (hidden states: b x t x d)
        matmul = 2 * _matmul_params(u.module)

        def per_token(t: int, width: float = width, matmul: int = matmul, n: int = len(found)) -> float:
            return matmul + 4 * t * width * n

        base = per_token(reference)
        out[u.name] = tokens * per_token(tokens) / (reference * base) if base > 0 else tokens / reference
    return out


def _matmul_params(module: nn.Module) -> int:
    """Parameters a token multiplies by (an embedding's rows are looked up, not multiplied)."""
    looked_up = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in looked_up)


__all__ = ["REFERENCE", "LengthFacts", "measure_lengths", "probe_lengths"]
