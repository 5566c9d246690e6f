"""Recomputation timed in place, for the planner: one block's forward and backward under torch's
non-reentrant checkpoint against the same block without it.

The forward once more, at the unit's measured forward, leaves out what the checkpoint itself costs: its
saved-tensor hooks on every tensor the forward saves (a placeholder packed in forward, the recomputed
tensor unpacked in backward), the RNG state kept and restored, and a recomputed forward that records
autograd. On the traced GPT and Hugging Face Llama of ``experiments/bench_autoplan.py`` the plans with
``+ac`` were measured 1.3-1.8x their prediction, beside 1.1-1.3x without. So ``plan="auto"`` measures the
block (the technique's ``measure`` member) and ``time`` charges each recomputed unit what the block
paid, as a multiple of its plain forward, at the unit's own forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.techniques.ledgers import Line, TimeBench


@dataclass(frozen=True)
class RecomputeTimes:
    """A block recomputed, measured in place, as lines in the micro-batch's samples: ``plain``: its
    forward without checkpointing; ``forward``/``backward``: what checkpointing added to its forward
    (the hooks) and to its backward (the forward again, the hooks).

    Example::

        times = measure_recompute(bench, wrap)    # on every rank of the job
        times.factors(8)                          # (forward, backward) extra per second of plain forward
    """

    plain: Line
    forward: Line
    backward: Line

    def factors(self, samples: float) -> tuple[float, float]:
        """What checkpointing adds to a unit's forward and to its backward, per second of the unit's plain
        forward, at micro-batches of ``samples``."""
        plain = self.plain.at(samples)
        if plain <= 0:
            return 0.0, 1.0
        return self.forward.at(samples) / plain, self.backward.at(samples) / plain


def measure_recompute(bench: TimeBench, recompute: Callable[[nn.Module], None]) -> RecomputeTimes | None:
    """The bench's block (its first sample) at each recorded size: forward, and forward with backward,
    plain and with its forward recomputed as the strategy recomputes a unit (``recompute``: the
    technique's wrapping of a module in place, torch's non-reentrant checkpoint); None where the block has
    no parameter that needs a gradient (nothing to recompute for).

    Example::

        measure_recompute(bench, wrap).backward.at(4)   # seconds recomputation adds to a backward at 4
    """
    sample = bench.samples[0]
    plain_block = copy.deepcopy(sample.module).to(bench.device)
    if not any(p.requires_grad for p in plain_block.parameters()):
        return None
    recomputed_block = copy.deepcopy(plain_block)
    recompute(recomputed_block)
    plain, forward, backward = [], [], []
    for size in sorted(sample.inputs):
        args, kwargs = bench.inputs(sample, size)

        def run(block: nn.Module, back: bool, a: Any = args, k: Any = kwargs) -> None:
            out = block(*a, **k)
            if back:
                TimeBench.backward(out)

        plain_forward = bench.timed(lambda: run(plain_block, back=False))
        plain_both = bench.timed(lambda: run(plain_block, back=True))
        recomputed_forward = bench.timed(lambda: run(recomputed_block, back=False))
        recomputed_both = bench.timed(lambda: run(recomputed_block, back=True))
        plain.append((size, plain_forward))
        forward.append((size, max(0.0, recomputed_forward - plain_forward)))
        extra = (recomputed_both - recomputed_forward) - (plain_both - plain_forward)
        backward.append((size, max(0.0, extra)))
    return RecomputeTimes(Line.through(plain), Line.through(forward), Line.through(backward))
