"""The host memory offload really takes, for ``bench_offload.py``: the process's resident memory around
each optimizer step, with no offload, host offload and the disk tier, measured, not counted.

Each measurement is one fit in a fresh process (``python experiments/_offload_resident.py <json>``, with
``_meters.MALLOC_ENV``: glibc returns what is freed, so the resident memory is what is live; a fresh
process, so no earlier fit's freed memory is reused) of the model ``bench_offload.py`` times, wider
(:data:`SHAPE`: its AdamW state several times the disk tier's larger buffer, so the buffer bounds a
stream of chunks and is not a copy of the whole state). ``_meters.ResidentMeter`` reads the resident
bytes when step 1's optimizer work starts (after its backward: the model, its gradients and the
framework are resident; nothing the optimizer makes at its first step is yet, though host offload's
weight copies, made when it is built, are) and each step's peak from its optimizer work's start to its
end. What a step holds: its peak over step 1's start.

The variants, interleaved over the repeats, a process each:

- ``no offload, SGD``: the same model with an optimizer that keeps no state (SGD without momentum): what
  a step holds with nothing of the optimizer's (the gradients' and the framework's transients): the
  baseline, subtracted from each variant's figure in the same repeat;
- ``no offload``: AdamW on the device, which is this machine's host memory: its state (the meter's check:
  it should measure the state's 8 bytes per parameter);
- ``offload optimizer (host)``: the host's weight copies, gradient buffers and AdamW state;
- ``on disk, <n> MiB buffer``: the disk tier at two buffer sizes, the state in files under a temporary
  directory; what the host holds should fall to the buffer (issue 54's goal: within 10%).

The first step is reported apart: it makes what the later steps reuse (host offload's copies, the disk
tier's buffer and each chunk's first state).

A helper module, not a script of its own (run by ``bench_offload.py``, one child process a measurement).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from _meters import MALLOC_ENV, ResidentMeter
from _offload_tiers import BATCH, LM, MICROBATCHES, SEQ_LEN
from models import ByteWindows
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

SHAPE = (256, 4)
"""Width and blocks: 3.3 M parameters, 26 MiB of AdamW state (a 16 MiB buffer streams it in 7 chunks)."""
STEPS = 5
BASELINE = "no offload, SGD"
VARIANTS: dict[str, dict[str, Any]] = {  # name -> PipelineStrategy options (and "stateless": SGD)
    BASELINE: {"stateless": True},
    "no offload": {},
    "offload optimizer (host)": {"offload": "optimizer"},
    "on disk, 2 MiB buffer": {"offload": "optimizer", "offload_to": "disk", "offload_buffer": 2 << 20},
    "on disk, 16 MiB buffer": {"offload": "optimizer", "offload_to": "disk", "offload_buffer": 16 << 20},
}


_RENDEZVOUS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


class StatelessLM(LM):
    """The benchmark's model with an optimizer that keeps no state: the baseline's."""

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Counted(L.Callback):
    """At the end of training (before the strategy's teardown closes the disk tier): what the optimizer
    holds by its own count: the disk tier's buffers at their peak, host offload's copies and state, or
    (no offload) the state's tensors."""

    nbytes = 0

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, DiskStepping):
            self.nbytes = optimizer.buffers.peak
        elif is_host_stepping(optimizer):
            self.nbytes = sum(optimizer.host_bytes().values())
        else:
            state = optimizer.state.values()
            self.nbytes = sum(v.nbytes for s in state for v in s.values() if torch.is_tensor(v))


def measure(variant: str, shape: tuple[int, int], steps: int, directory: str) -> dict[str, Any]:
    """One fit of ``variant`` in this process: the meter's readings (run in a fresh process)."""
    options = dict(VARIANTS[variant])
    model = (StatelessLM if options.pop("stateless", False) else LM)(*shape, fused=False)
    if options.get("offload_to") == "disk":
        options["offload_dir"] = directory
    torch.manual_seed(0)
    meter, held = ResidentMeter(), Counted()
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=MICROBATCHES, **options)
    trainer = h.quiet_trainer(devices=1, strategy=strategy, max_steps=steps, callbacks=[meter, held])
    data = ByteWindows.of_stdlib((steps + 1) * BATCH, SEQ_LEN)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, drop_last=True))
    steps_held = [peak - meter.starts[0] for peak in meter.peaks]
    return {"first": steps_held[0], "later": statistics.median(steps_held[1:]), "counted": held.nbytes,
            "buffer": options.get("offload_buffer", 0),
            "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip


def in_child(variants: list[str], shape: tuple[int, int], steps: int, directory: str) -> list[dict[str, Any]]:
    """:func:`measure` of each of ``variants``, one after the other, in a fresh process with glibc's
    settings for measuring (``MALLOC_ENV``)."""
    request = json.dumps({"variants": variants, "shape": shape, "steps": steps, "directory": directory})
    # (not this process's rendezvous: its earlier fits left their port and ranks in the environment)
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env |= {**MALLOC_ENV, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(h.free_port())}
    out = h.run_child([sys.executable, __file__, request], env=env)
    return json.loads(out.strip().splitlines()[-1])


def resident_rows(
    shape: tuple[int, int], steps: int, repeats: int, names: tuple[str, ...] = tuple(VARIANTS),
    one_process: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per variant of ``names`` (the baseline among them): what a step holds (first, later; the
    baseline's subtracted in each repeat). Each variant is a process of its own (~5 s of imports); with
    ``one_process`` (``--quick``'s smoke run), one process fits them all, one after the other, once: an
    earlier fit's freed memory is then a later one's, so its figures only show that the path runs."""
    if BASELINE not in names:
        raise ValueError(f"resident_rows needs the baseline {BASELINE!r} among {names}")
    with tempfile.TemporaryDirectory(prefix="bench_offload_rss_") as directory:
        if one_process:
            found = in_child(list(names), shape, steps, directory)
            samples = [
                dict(repeat=0, variant=n, position=i, **f) for i, (n, f) in enumerate(zip(names, found))
            ]
        else:
            runs = {name: (lambda name=name: in_child([name], shape, steps, directory)[0]) for name in names}
            samples = h.interleave(runs, repeats=repeats)
    base = {s["repeat"]: s for s in samples if s["variant"] == BASELINE}
    rows = []
    for name in names:
        mine = [s for s in samples if s["variant"] == name]
        row: dict[str, Any] = {"variant": name, "baseline": BASELINE, "repeats": len(mine)}
        for key in ("first", "later"):
            row |= h.spread(s[key] for s in mine).cells(f"{key}_step_bytes", 0)
            net = [s[key] - base[s["repeat"]][key] for s in mine]
            row |= h.spread(net).cells(f"{key}_step_over_baseline_bytes", 0)
            if mine[0]["buffer"]:
                row |= h.spread(n / s["buffer"] for n, s in zip(net, mine)).cells(
                    f"{key}_step_over_buffer", 3
                )
        row |= {"counted_bytes": mine[-1]["counted"], "buffer_bytes": mine[0]["buffer"], "steps": steps,
                "parameters": mine[0]["parameters"], "model_dim": shape[0], "model_depth": shape[1],
                "batch": BATCH, "microbatches": MICROBATCHES}  # fmt: skip
        rows.append(row)
    return rows


RESIDENT_COLUMNS = ["variant", "baseline", "repeats"] + [
    f"{key}_step_{what}{end}"
    for key in ("first", "later")
    for what in ("bytes", "over_baseline_bytes", "over_buffer")
    for end in ("", "_min", "_max")
] + ["counted_bytes", "buffer_bytes", "steps", "parameters", "model_dim", "model_depth", "batch",
     "microbatches"]  # fmt: skip


# ------------------------------------------------------------------- its table in docs/results.md


def offload_resident(rows: t.Rows) -> str:
    def mib(r: dict[str, str], key: str) -> str:
        return t.timed(*(float(r[f"{key}{end}"]) / 2**20 for end in ("", "_min", "_max")), 2)

    body = []
    for r in rows:
        buffer = [t.timed_col(r, f"{k}_step_over_buffer", 3) if r["buffer_bytes"] != "0" else "-"
                  for k in ("later", "first")]  # fmt: skip
        over = [mib(r, f"{k}_step_over_baseline_bytes") if r["variant"] != r["baseline"] else "0"
                for k in ("later", "first")]  # fmt: skip
        body.append([r["variant"], r["repeats"], mib(r, "later_step_bytes"), over[0], buffer[0],
                     mib(r, "first_step_bytes"), over[1], buffer[1],
                     t.fixed(float(r["counted_bytes"]) / 2**20, 2)])  # fmt: skip
    header = ["variant", "repeats", "a later step holds MiB", "over the baseline MiB", "over the buffer",
              "the first step holds MiB", "over the baseline MiB", "over the buffer",
              "its own count MiB"]  # fmt: skip
    r0 = rows[0]
    note = (
        f"\n\nThe process's resident memory, measured (`/proc/self/status`): `SequentialCharLM` width "
        f"{r0['model_dim']}, {r0['model_depth']} blocks ({r0['parameters']} parameters), AdamW, "
        f"batch {r0['batch']} in {r0['microbatches']} micro-batches, fits of {r0['steps']} steps, each in a "
        "fresh process with glibc returning what is freed, the variants interleaved, median (min .. max) "
        "over the repeats. What a step holds: its peak resident memory, from its optimizer work's start to "
        "its end, over the resident memory when step 1's optimizer work started (a later step: the median "
        "of steps 2 on). Over the baseline: less what the baseline held in the same repeat (`no offload, "
        "SGD`: an optimizer with no state: the gradients' and the framework's own transients); over the "
        "buffer: that over the disk tier's `offload_buffer`. Its own count: the state's tensors (no "
        "offload; on this machine the device's memory is the host's), host offload's copies and state "
        "(`host_bytes`; its weight copies are made when the optimizer is built, before step 1's start, "
        "so the step's figure leaves them out), the disk tier's buffers at their peak (`HostBuffers.peak`)."
    )
    return t.table(header, body) + note


def _main() -> None:
    """A child's entry: the measurements, printed as a JSON list on the last line."""
    h.quiet()
    request = json.loads(sys.argv[1])
    print(json.dumps([measure(v, tuple(request["shape"]), request["steps"], request["directory"])
                      for v in request["variants"]]))  # fmt: skip


if __name__ == "__main__":
    _main()
