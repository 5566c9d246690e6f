"""A stage's gradients: held aside for Lightning's backward, averaged over replicas, clipped globally."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_parallel.distributed.tensors import all_reduce_coalesced

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


def all_reduce_gradients(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Average the gradients of ``params`` over ``group`` in one coalesced all-reduce (per dtype).

    Called once per optimizer step, after the last accumulated backward: no sync per micro-batch.
    """
    all_reduce_coalesced([p.grad for p in params if p.grad is not None], group, average=True)


def clip_grad_norm_across(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    not_counted: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every stage of the pipeline.

    Each stage holds a slice of the model's gradients; the sum of squares (or the max, for the inf
    norm) is reduced over ``group`` so every stage scales by the same coefficient a single device would.
    ``not_counted`` are replicas of tied weights whose norm another stage counts (one count per weight).
    """
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in not_counted}
    grads = [p.grad for p in params]
    counted = [p.grad for p in params if id(p) not in skip]
    device = grads[0].device if grads else torch.device("cpu")
    inf = norm_type == float("inf")
    if counted:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).float() for g in counted])
        local = norms.max() if inf else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    all_reduce_coalesced([local], group, op="max" if inf else "sum")
    total = local if inf else local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
