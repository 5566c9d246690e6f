"""The pieces the byte-level LM's pipeline benchmarks share: their config, model, data and baseline.

``bench_pipeline.py`` and ``bench_schedules.py`` train ``models.SequentialCharLM`` on the same stdlib
bytes, in the same order, and compare the pipeline with one process training the whole model on the same
micro-batches (:func:`run_single`). A helper module, not a script: nothing runs at import time.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import _harness as h
import torch
import torch.nn.functional as F
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader, DistributedSampler

FAST = 0.2  # the quantile of step cycles behind the "fast" columns


@dataclass
class Config:
    """What one benchmark invocation runs (the same object reaches every worker)."""

    dim: int = 128
    depth: int = 4
    seq_len: int = 64
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 3
    steps: int = 12
    repeats: int = 6
    overhead_schedule: str = "1f1b"
    overhead_microbatches: int = 4
    sweep_repeats: int = 5
    sweep_steps: int = 8
    microbatches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    schedules: list[str] = field(default_factory=lambda: ["gpipe", "1f1b"])
    seed: int = 0


def build_model(cfg: Config) -> SequentialCharLM:
    torch.manual_seed(cfg.seed)
    return SequentialCharLM(dim=cfg.dim, depth=cfg.depth, seq_len=cfg.seq_len, lr=cfg.lr)


def loader(cfg: Config, steps: int) -> DataLoader:
    data = ByteWindows.of_stdlib((cfg.warmup + steps + 2) * cfg.batch_size, cfg.seq_len)
    # The sampler Lightning injects into the Trainer's loader (one replica, shuffled with seed 0),
    # so the hand loop and the Trainer see the same batches in the same order.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)


def measured(
    clock: h.StepClock, cfg: Config, spans: list[tuple[float, float]] | None = None
) -> dict[str, Any]:
    """Throughput (batch over the median step cycle, and over a fast quantile), step time, losses; with
    ``spans`` (the schedule's steps, ``bench_pipeline.schedule_spans``), the median time outside the
    schedule."""
    out = dict(
        samples_per_s=cfg.batch_size / clock.cycle_quantile_s(cfg.warmup),
        fast_samples_per_s=cfg.batch_size / clock.cycle_quantile_s(cfg.warmup, FAST),
        step_ms=clock.median_step_ms(cfg.warmup),
        losses=clock.losses,
    )
    if spans is not None:
        timed = spans[cfg.warmup :]
        out["outside_ms"] = 1e3 * statistics.median(b[0] - a[1] for a, b in itertools.pairwise(timed))
    return out


def run_single(cfg: Config, m: int, steps: int) -> dict[str, Any]:
    """One process trains the whole model, the batch in m micro-batches (gradient accumulation)."""
    model = build_model(cfg).layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    clock = h.StepClock()
    for step, (x, y) in enumerate(loader(cfg, steps)):
        if step == cfg.warmup + steps:
            break
        clock.starts.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            loss = F.cross_entropy(model(xc).flatten(0, 1), yc.flatten()) / m
            loss.backward()
            total += float(loss)
        optimizer.step()
        clock.ends.append(time.perf_counter())
        clock.losses.append(total)
    return measured(clock, cfg)
