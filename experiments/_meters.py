"""Memory meters the experiments share: activations saved for backward, and a training step's peak.

- :class:`SavedTensorMeter`: the live bytes of the tensors autograd saves for backward, and their peak
  (``bench_pipeline_memory.py``, ``bench_schedules.py``).
- :class:`StepMeter`: torch's ``MemTracker`` around one training step, this rank's peak total bytes
  (``memory_validation.py``, ``bench_fsdp_memory.py``), with the private torch 2.13 details it leans on
  (:func:`blind_to_modules`, :func:`pipeline_buffers`, :func:`fsdp_unsharded_params`).
- :class:`ResidentMeter`: the process's resident memory (Linux ``/proc/self/status``) at each optimizer
  step's start and its peak during the step: what a host really holds, not what a tensor count says
  (``_offload_resident.py``); run it in a process started with :data:`MALLOC_ENV`.

A helper module, not a script: nothing here runs at import time beyond definitions.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Any

import lightning as L
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

# ------------------------------------------------------------------------- activations (autograd)


class SavedTensorMeter:
    """Live bytes of the tensors autograd saves for backward (activations), and their peak.

    Installed with ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor is wrapped in a
    holder that counts its storage once (however often it is saved) until autograd frees the graph.
    Parameters saved by their ops (a Linear saves its weight) are not activations: not counted.
    """

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters if not p.is_meta}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if t.is_meta or ptr == 0 or ptr in self.excluded:
            return t
        return _Saved(self, t, ptr)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    __slots__ = ("meter", "nbytes", "ptr", "tensor")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, ptr: int) -> None:
        self.meter, self.tensor, self.ptr = meter, tensor, ptr
        self.nbytes = tensor.untyped_storage().nbytes()
        meter.refs[ptr] = meter.refs.get(ptr, 0) + 1
        if meter.refs[ptr] == 1:
            meter.live += self.nbytes
            meter.peak = max(meter.peak, meter.live)

    def __del__(self) -> None:
        refs = self.meter.refs
        refs[self.ptr] -= 1
        if not refs[self.ptr]:
            del refs[self.ptr]
            self.meter.live -= self.nbytes


# ------------------------------------------------------------------- one training step (MemTracker)


def blind_to_modules(tracker: MemTracker) -> MemTracker:
    """Turn off MemTracker's per-module attribution; its dispatch-mode byte counting stays as it is.

    torch 2.13's MemTracker attributes memory to modules through a ModTracker whose hooks raise on a
    module called more than once per iteration ("multiple iterative calls"): a pipeline stage runs
    once per micro-batch. The peak (``get_tracker_snapshot("peak")["Total"]``) is computed in
    ``__torch_dispatch__`` from every tensor created, and reads only ``parents`` and ``is_bw`` of the
    module tracker, which this stand-in provides. No public switch exists; if the attribute moves,
    this raises (``tests/test_memory_validation.py`` runs it).
    """
    if not hasattr(tracker, "_mod_tracker"):
        raise RuntimeError("MemTracker has no _mod_tracker: torch changed it (checked against 2.13)")

    class _NoModules:
        parents = {"Global"}

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

        def register_user_hooks(self, *hooks: Any) -> None: ...
        def clear_user_hooks(self) -> None: ...
        def __enter__(self) -> _NoModules:
            return self

        def __exit__(self, *exc: Any) -> None: ...

    tracker._mod_tracker = _NoModules()
    return tracker


def pipeline_buffers(strategy: Any) -> list[torch.Tensor]:
    """The receive buffers of this rank's cached pipeline stages (allocated at the warm-up step).

    torch 2.13 keeps them in a stage's ``args_recv_info`` / ``grad_recv_info`` (one ``_RecvInfo`` per
    micro-batch, with a ``buffer``); the runner caches its schedules in ``_cache``. Both private: read
    here only to tell the meter about tensors that exist outside the tracked step.
    """
    parts = getattr(strategy, "parts", None)
    if parts is None:
        return []
    out = []
    for schedule, _ in parts.runner._cache.values():
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                out += [i.buffer for i in infos if torch.is_tensor(getattr(i, "buffer", None))]
    return out


def fsdp_unsharded_params(strategy: Any) -> list[torch.Tensor]:
    """The unsharded parameters of this rank's FSDP2 stages (storage freed between steps).

    FSDP2 all-gathers into these tensors by resizing their storage (``UntypedStorage.resize_``), which
    MemTracker counts only for storages it already knows (as torch's ``FSDPMemTracker`` registers
    them): told of them at size 0 before the tracked step, it sees them grow. torch 2.13 keeps them in
    each FSDP parameter group's ``fsdp_params[i]._unsharded_param`` (private, read here only).
    """
    parts = getattr(strategy, "parts", None)
    out = []
    for root in getattr(parts, "sharded", None) or []:
        for module in root.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            out += [
                p._unsharded_param
                for p in (group.fsdp_params if group else [])
                if hasattr(p, "_unsharded_param")
            ]
    return out


def host_copies(optimizers: list[Any]) -> list[torch.Tensor]:
    """The host copies of an offloaded optimizer's parameters and their gradient buffers (made at the first
    step, outside the tracked one). ``techniques/offload/host_optimizer.py: HostStepping`` keeps them in
    ``_copies`` (this package's own private name, read here only to tell the meter of them)."""
    out = []
    for optimizer in optimizers:
        for group in getattr(optimizer, "_copies", []):
            out += [t for copy in group if copy is not None for t in (copy.host, copy.grad)]
    return out


class StepMeter(L.Callback):
    """MemTracker around training step ``step`` (after warm-up); the peak total bytes of this rank."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.peak = self.start = 0
        self.tracker: MemTracker | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.step:
            return
        self.tracker = blind_to_modules(MemTracker())
        # A ZeroRedundancyOptimizer keeps its shard's state in the local optimizer it wraps (.optim).
        optimizers = [getattr(o, "optim", o) for o in trainer.optimizers]
        strategy = trainer.strategy
        self.tracker.track_external(
            pl_module, *optimizers, batch, *pipeline_buffers(strategy), *fsdp_unsharded_params(strategy),
            *host_copies(optimizers),
        )  # fmt: skip
        self.start = _total(self.tracker.get_tracker_snapshot("current"))
        self.tracker.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.step or self.tracker is None:
            return
        self.tracker.__exit__(None, None, None)
        self.peak = _total(self.tracker.get_tracker_snapshot("peak"))


def _total(snapshot: dict) -> int:
    return int(sum(dev.get("Total", 0) for dev in snapshot.values()))


# ------------------------------------------------------------------------ the process's resident memory

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
"""glibc's settings for a process whose resident memory is measured. By default glibc keeps what a
program frees in its heap and raises its mmap threshold as large blocks come and go, so the resident
memory would show what was once allocated, not what is live; with a fixed threshold every block of
64 KiB or more is its own mapping, returned to the system when freed. Set in the environment of a fresh
process (glibc reads it at start-up)."""


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``"VmRSS:"``, ``"VmHWM:"``) in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return 1024 * int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset the process's peak resident memory (``VmHWM``) to its current one; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class ResidentMeter(L.Callback):
    """The process's resident bytes at each optimizer step's start (after backward, before the optimizer's
    work: Lightning calls ``on_before_optimizer_step`` inside ``optimizer.step``, once the closure has run)
    and its peak from there to the step's end (``VmHWM``, reset at the start).

    Example::

        meter = ResidentMeter()
        h.quiet_trainer(max_steps=4, callbacks=[meter]).fit(model, loader)
        [peak - meter.starts[0] for peak in meter.peaks]   # what each step held over step 1's start
    """

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.peaks: list[int] = []

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):  # (not glibc: nothing to trim)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        if not reset_peak():
            raise RuntimeError("/proc/self/clear_refs cannot be written here: the peak cannot be measured")
        self.starts.append(status_bytes("VmRSS:"))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.peaks.append(status_bytes("VmHWM:"))
