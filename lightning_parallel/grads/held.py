"""A stage's gradients, held aside for Lightning's backward: the schedule runs backward in training_step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

EARLIER_GRADIENTS = ("keep", "drop", "add")


class HeldGradients:
    """The gradients a schedule computes inside ``training_step``, kept aside until Lightning's backward.

    The schedule runs backward inside training_step, but Lightning zeroes the gradients between
    training_step and backward (on the first batch of each accumulation window). Holding this batch's
    gradients aside and adding them in the strategy's ``backward`` keeps Lightning's order exact.

    What happens to the gradients already in ``.grad`` (``earlier``):

    - ``"keep"``: set aside during the schedule and put back after it (two gradients' worth of memory).
    - ``"drop"``: released before the schedule, when Lightning zeroes them after this training_step
      anyway (the first batch of a window): one gradient's worth of memory less.
    - ``"add"``: the schedule adds this batch's gradients into them, nothing is held (inside a window,
      where Lightning does not zero): also one gradient's worth less.

    Example::

        held = HeldGradients()
        with held.collecting(params, earlier="drop"):
            schedule.step(...)          # .grad of params: this batch only
        held.add_to_grads()             # later, in backward: .grad += this batch's gradients
    """

    def __init__(self) -> None:
        self._held: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []

    @contextmanager
    def collecting(self, params: Sequence[torch.nn.Parameter], earlier: str = "keep") -> Iterator[None]:
        if earlier not in EARLIER_GRADIENTS:
            raise ValueError(f"earlier must be one of {EARLIER_GRADIENTS}, got {earlier!r}")
        self._held = []
        if earlier == "add":
            yield
            return
        kept = [p.grad if earlier == "keep" else None for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._held = [(p, p.grad) for p in params]
            for p, g in zip(params, kept):
                p.grad = g

    def add_to_grads(self) -> None:
        for p, g in self._held:
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._held = []
