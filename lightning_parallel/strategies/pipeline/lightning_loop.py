"""What Lightning's loop around the strategy's step costs on this machine: a one-device Trainer on each rank.

``plan="auto"`` times plans by the strategy's own step (:mod:`.trials`), which a user's steps run inside
Lightning's loop: each batch's hooks, the closure, the logger connector, the data loader's next batch;
the optimizer wrapper once a step (4-6 ms a step on this 2-core machine, ``docs/planner.md``). Lightning's
loop cannot run at ``setup`` (the job's fit is setting up), so a Trainer of its own, one device, no logger,
checkpoints, progress bar or summary, fits the trivial stage of :mod:`.trials` on each rank at once (as
the steps will share the machine) at one batch a step and at three: what its steps take beyond the
trivial stage's own forward, backward and optimizer step, per step and per batch. The job's own
callbacks are not run (a callback with per-step work of its own is not counted).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_parallel.strategies.pipeline.trials import _Trivial

WINDOWS = (1, 3)
"""Batches per optimizer step of the two runs: their difference is what a batch costs in the loop."""


class _Clock(pl.Callback):
    """When each batch started."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def loop_seconds(steps: tuple[int, int] = (5, 20)) -> tuple[float, float]:
    """``(per optimizer step, per batch)``: seconds Lightning's loop adds to a step beyond the step's own
    work, from ``steps`` = (warm-up, timed) optimizer steps at each window of :data:`WINDOWS`; every rank
    may call it at once (no collective).

    Example::

        per_step, per_batch = loop_seconds()       # e.g. (0.001, 0.003) on a busy 2-core machine
    """
    warmup, timed = steps
    per_step = {}
    with _quiet():
        for window in WINDOWS:
            clock = _Clock()
            _fit(clock, window, warmup + timed + 1)
            starts = clock.starts[::window]
            spans = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :])]
            per_step[window] = statistics.median(spans) if spans else 0.0
    forward_backward, optimizer = _bare(warmup + timed)
    a, b = WINDOWS
    batch = max(0.0, (per_step[b] - per_step[a]) / (b - a) - forward_backward)
    step = max(0.0, per_step[a] - a * (batch + forward_backward) - optimizer)
    return step, batch


def _fit(clock: _Clock, window: int, steps: int) -> None:
    module = _Trivial()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=window, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[clock], default_root_dir=root,
        )  # fmt: skip
        trainer.fit(module, DataLoader(torch.zeros(4 * window * steps, 1), batch_size=4))


def _bare(runs: int) -> tuple[float, float]:
    """The trivial stage's own forward + backward, and its optimizer step, timed bare (median seconds)."""
    module = _Trivial()
    optimizer = module.configure_optimizers()
    x = torch.zeros(4, 1)
    passes, steps = [], []
    for _ in range(runs):
        start = time.perf_counter()
        module(x).sum().backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        passes.append(middle - start)
        steps.append(time.perf_counter() - middle)
    return statistics.median(passes), statistics.median(steps)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The inner Trainer's messages and warnings kept from the job's output."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [g.level for g in loggers]
    for g in loggers:
        g.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for g, level in zip(loggers, levels):
            g.setLevel(level)
