"""The disk tier: the user's optimizer with its state in files, streamed through a bounded host buffer.

When the host cannot hold the optimizer state either (several ranks of a node sharing its memory), the
state (and the fp32 master of bf16 / fp16 parameters) lives in files under a directory the user names,
one directory per rank (``scratch.py``). Once per optimizer step, after backward, clipping and unscaling
on the device, the chunks of the state (``disk_layout.py``) stream through the host buffer
(``disk_stream.py``, its slots and work area sized by ``disk_tier.py``): one is read while the one
before steps and the one before that is written back.
For each chunk (``disk_chunk.py``) the gradients come down (pinned and non-blocking on an accelerator),
the user's class steps it with its fastest host kernel, the updated parameters go up. The numbers are
the whole step's: torch's fused host kernels step a chunk bitwise as the whole tensors (fp32 parameters:
the device's own values are stepped; bf16 / fp16: the fp32 master kept in the file, rounded on the way
up, as ``shard_optimizer.py`` does on the host).

One class for every data-parallel mode (:func:`disk_stepping`, named as the user's): plain replicas,
ZeRO-1 (``ZeroRedundancyOptimizer(optimizer_class=disk_stepping(cls, tier))``: each replica's shard from
its own files) and FSDP2 shards (DTensor parameters: their local shards step; the state shows as
DTensors placed as them). ``state_dict()`` reads the state from the files (``disk_group.py``; the rank's
state is on the host while a checkpoint is written, as without the tier); ``load_state_dict()`` writes
it to them, in a plain optimizer's layout. The files are scratch: made afresh by each run, removed by
:meth:`DiskStepping.close` (at the strategy's teardown; after a normal end with the state read into host
tensors first, for a checkpoint saved after ``fit``), when the optimizer is collected, at the
interpreter's exit, and by the kernel on a kill where they are unnamed (Linux ``O_TMPFILE``); a
directory a killed run left is emptied by the next run, which takes its state from the checkpoint it
resumes from.

Integration plan (issue 54's next phase; the fields are offload's, one technique's):

* Fields: ``offload_to="host" | "disk"`` (default ``"host"``), ``offload_dir`` (required with
  ``"disk"``; each rank uses ``<offload_dir>/rank<R>``), ``offload_buffer`` (bytes or ``"1GiB"``, default
  1 GiB: the host's bound per rank, per optimizer). ``check()`` refuses, with the fix: ``"disk"`` without
  ``"optimizer"`` in ``offload`` ("offload_to='disk' moves the optimizer state: add 'optimizer' to
  offload"); ``"disk"`` with ``"parameters"`` (not supported yet: the same class would step FSDP2's host
  shards, untested); ``offload_dir`` missing with ``"disk"`` or given with ``"host"``; an
  ``offload_buffer`` that is no positive size; tensor parallelism (as offload refuses now). The
  directory, its room and its writability are checked at set-up, every rank agreeing (``agree``) before
  any step: building the optimizers raises them (``disk_step``: ``ValueError`` with the values).
* ``optimizers()``: replicas ``disk_step(o, tier)``; ZeRO-1 ``disk_step(o, tier, dp_group, shard=True)``;
  FSDP2 / HSDP ``disk_step(o, tier)`` over the DTensor shards, and for ``offload_to="host"``
  ``shard_optimizer.host_step_shards`` (lifting today's refusal of ``"optimizer"`` alone under FSDP2).
  ``environment()``: the host backend beside the device's (the state's DTensors have host tensors, which
  the consolidated save gathers). The strategy's teardown and its stop call ``close()``; a failed step
  (``DiskFullError``) ends the job on every rank through ``agree``, the last checkpoint untouched.
* Memory: the device loses the state (AdamW: 8 bytes per trainable element; bf16 / fp16: the master's
  4 too); the host holds the buffer, not the state; a disk column per node holds the state and masters
  of the node's ranks (+ up to 4 KiB per chunk of alignment).
* Time: per optimizer step the state is read and written once at the disk's bandwidth (measured once,
  as the host copy is), overlapped with the host step chunk by chunk: about ``max(2 x state / disk
  bandwidth, host step) + one chunk's read and write``, plus host offload's gradient and parameter copies.
* Checkpoints: the paths as they are (``state_dict()`` / ``load_state_dict()``, consolidated or DCP); the
  scratch files are never read at a resume.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import defaultdict
from typing import Any

import torch

from lightning_parallel.distributed.agree import agree
from lightning_parallel.optim import sharded as zero_sharding
from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.techniques.offload.disk_chunk import ChunkStep
from lightning_parallel.techniques.offload.disk_group import DiskState, GroupFile, GroupSpec, group_spec, seen
from lightning_parallel.techniques.offload.disk_layout import Chunk, plan_group
from lightning_parallel.techniques.offload.disk_stream import HostBuffers, Stream

# (DiskTier is also imported from here, beside disk_step, by the technique, the tests and experiments)
from lightning_parallel.techniques.offload.disk_tier import DiskTier, buffer_split, max_elements
from lightning_parallel.techniques.offload.host_optimizer import host_kernel
from lightning_parallel.techniques.offload.scratch import ScratchDir, check_room


class DiskStepping:
    """The user's optimizer class with its state in files: mixed in first by :func:`disk_stepping`.

    ``param_groups`` are the user's (device parameters or DTensor shards; the hyper-parameters LR
    schedulers, clipping and the GradScaler read and write); the state is in the files of
    ``<tier.directory>/rank<R>``, one per param group. ``buffers`` counts the host buffers (``peak``:
    the measured bound); ``seconds``: the time in steps and, of it, waiting on the disk.
    """

    _user_class: type
    _tier: DiskTier

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._user_class.__init__(self, params, *args, **kwargs)
        self._step_supports_amp_scaling = False  # the GradScaler unscales the device gradients first
        defaults = accepted_settings(self._user_class, self.defaults)
        kernel = host_kernel(self._user_class, defaults, torch.float32)
        self._chunk_step = ChunkStep(self._user_class, kernel, defaults, self._tier.pin_memory)
        self._scratch = ScratchDir.acquire(self._tier.directory, self._tier.rank_now())
        self._disk: list[GroupFile] = []
        self._stream: list[Stream] = []  # (made at the first step: a list, so the finalizer shares it)
        try:
            specs = [group_spec(self._user_class, g, kernel) for g in self.param_groups]
            self._slot_bytes, self._work_bytes = buffer_split(specs, self._tier.buffer_bytes)
            self._lay_out(specs)
        except BaseException:
            _close(self._disk, self._stream, self._scratch)
            raise
        self.state = DiskState(self)
        self.buffers = HostBuffers()
        self.seconds = {"step": 0.0, "waiting": 0.0}
        self._failed: BaseException | None = None
        self._kept = False  # closed with its state read into host tensors
        self._refresh: list[set[int]] = []
        self._closer = weakref.finalize(self, _close, self._disk, self._stream, self._scratch)

    def _lay_out(self, specs: list[GroupSpec]) -> None:
        slot, work = self._slot_bytes, self._work_bytes
        layouts = [plan_group(s.numels, s.keys, max_elements(s, slot, work), s.elementwise) for s in specs]
        check_room(self._scratch.path, sum(layout.file_bytes for layout in layouts))
        for spec, layout in zip(specs, layouts):
            self._disk.append(
                GroupFile(spec, layout, self._scratch.new_file(layout.file_bytes, self._tier.unnamed))
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._user_class.add_param_group(self, param_group)
        if "_disk" in self.__dict__:  # (a group added after construction: BackboneFinetuning's)
            spec = group_spec(self._user_class, self.param_groups[-1], self._chunk_step.kernel)
            slot, work = buffer_split([*(f.spec for f in self._disk), spec], self._tier.buffer_bytes)
            if slot > self._slot_bytes or work > self._work_bytes:
                # The buffer was sized to the groups it had (a head, before the backbone joins): it grows,
                # up to the tier's, and the next step allocates it anew (the laid-out chunks still fit).
                for stream in self._stream:
                    stream.close()
                self._stream.clear()
                self._slot_bytes, self._work_bytes = max(slot, self._slot_bytes), max(work, self._work_bytes)
            self._lay_out([spec])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's: backward, then clipping and unscaling on the device
            with torch.enable_grad():
                loss = closure()
        error = None
        try:
            self._stream_step()
        except Exception as err:
            error = err
        # Every rank steps its optimizers at the same point: one rank's full disk (or any failure of
        # its step) ends the step on every rank with that message, no peer left waiting in the next
        # collective until the process group's timeout (one all-reduce of a flag when all went well).
        agree(error)
        return loss

    def _stream_step(self) -> None:
        """The step proper: the chunks streamed through the buffer (a failure marks the files broken)."""
        if self._failed is not None:
            raise RuntimeError(
                "the disk tier's optimizer failed in an earlier step (its files are partly written): "
                "resume from the last checkpoint"
            ) from self._failed
        self._check_unfrozen()
        start = time.perf_counter()
        self._refresh = [self._stale_masters(g) for g in range(len(self._disk))]
        chunks = [(g, c) for g, f in enumerate(self._disk) for c in f.layout.chunks if self._has_grads(g, c)]
        if not self._stream:
            self._stream.append(
                Stream(self.buffers, self._slot_bytes, self._work_bytes, self._tier.pin_memory)
            )
        stream = self._stream[0]
        waited = stream.waited
        try:
            stream.run(chunks, self._read, self._step, self._write)
        except BaseException as err:
            self._failed = err
            raise
        self._note_masters(chunks)
        self.seconds["step"] += time.perf_counter() - start
        self.seconds["waiting"] += stream.waited - waited

    def _check_unfrozen(self) -> None:
        """A parameter frozen when the files were laid out has no room in them: refuse to skip it."""
        for group, group_file in zip(self.param_groups, self._disk):
            for p, numel in zip(group["params"], group_file.spec.numels):
                if numel is None and p.grad is not None:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} was frozen when the optimizer was built and "
                        f"has a gradient now: the disk tier has no room for its state. Build the optimizer "
                        f"after unfreezing, or add the parameter as a new param group (as Lightning's "
                        f"BackboneFinetuning does)"
                    )

    def _has_grads(self, g: int, chunk: Chunk) -> bool:
        params = self.param_groups[g]["params"]
        return any(params[p.index].grad is not None for p in chunk.pieces)

    def _stale_masters(self, g: int) -> set[int]:
        """Group ``g``'s bf16 / fp16 tensors whose master is taken from the device before this step:
        never stepped, or written since by someone else (a checkpoint's weights, a broadcast)."""
        group_file = self._disk[g]
        return {
            i
            for i, p in enumerate(self.param_groups[g]["params"])
            if group_file.spec.low[i] and (i not in group_file.masters or group_file.seen.get(i) != seen(p))
        }

    def _note_masters(self, chunks: list[tuple[int, Chunk]]) -> None:
        for g, chunk in chunks:
            group_file, params = self._disk[g], self.param_groups[g]["params"]
            for i in {p.index for p in chunk.pieces if group_file.spec.low[p.index]}:
                if params[i].grad is not None:
                    group_file.masters.add(i)
                    group_file.seen[i] = seen(params[i])

    def _read(self, item: tuple[int, Chunk], slot: torch.Tensor) -> None:
        g, chunk = item
        group_file = self._disk[g]
        if any((p.index, p.start) in group_file.small or p.index in group_file.masters for p in chunk.pieces):
            group_file.file.read_into(chunk.offset, slot[: chunk.nbytes(group_file.spec.keys)])

    def _step(self, item: tuple[int, Chunk], slot: torch.Tensor, work: torch.Tensor) -> bool:
        g, chunk = item
        return self._chunk_step(self.param_groups[g], self._disk[g], chunk, slot, work, self._refresh[g])

    def _write(self, item: tuple[int, Chunk], slot: torch.Tensor) -> None:
        g, chunk = item
        group_file = self._disk[g]
        group_file.file.write_from(chunk.offset, slot[: chunk.nbytes(group_file.spec.keys)])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Write a state dict (a plain optimizer's layout, or this one's) into the files.

        Raises:
            ValueError: its param groups are not this optimizer's, or its state is another optimizer's.
        """
        saved_groups = state_dict["param_groups"]
        sizes = ([len(g["params"]) for g in saved_groups], [len(g["params"]) for g in self.param_groups])
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"the loaded optimizer state has other param groups than this optimizer (sizes {sizes[0]} "
                f"against {sizes[1]}): resume with the same param grouping"
            )
        params = {}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            params.update(zip(saved["params"], group["params"]))
        for param in list(self.state):
            del self.state[param]
        for pid, values in state_dict["state"].items():
            self.state[params[pid]] = values

    def close(self, keep_state: bool = False) -> None:
        """Stop the threads, free the buffers, remove the files (and the rank's directory if no other
        optimizer uses it). The optimizer cannot step afterwards.

        ``keep_state``: the state is read from the files into host tensors first (a run that ended
        normally: a checkpoint saved after it, ``trainer.save_checkpoint`` or ``on_fit_end``, holds it,
        as Lightning's teardown leaves any optimizer's state on the host; the host then holds this rank's
        state, as it does while a checkpoint is written). Otherwise (an interrupted run, a failed step:
        its files may be partly written) ``state`` is empty and ``state_dict()`` refused."""
        if not self._closer.alive:  # (closed already)
            return
        kept: dict[Any, dict[str, Any]] | None = None
        try:
            if keep_state and self._failed is None:
                kept = {param: self.state[param] for param in self.state}
        finally:
            self._closer.detach()  # (the finalizer will not run)
            _close(self._disk, self._stream, self._scratch, wait=True)
            self.state = defaultdict(dict, kept or {})
            self._kept = kept is not None
            self._failed = RuntimeError("closed")

    def state_dict(self) -> dict[str, Any]:
        if not self._closer.alive and not self._kept:
            raise RuntimeError(
                "the disk tier's optimizer was closed when its run was interrupted (an error, a stop) or "
                "one of its steps failed: its state was in scratch files, now removed. Resume from the "
                "last checkpoint saved during the run (ModelCheckpoint, save_on_exception=True)"
            )
        return self._user_class.state_dict(self)

    def disk_bytes(self) -> int:
        """Bytes of this optimizer's files (reserved when it was built)."""
        return sum(f.layout.file_bytes for f in self._disk)


def _close(files: list[GroupFile], stream: list[Stream], scratch: ScratchDir, wait: bool = False) -> None:
    """Release what an optimizer holds; also its finalizer (``wait`` False: see ``Stream.close``)."""
    for s in stream:
        s.close(wait=wait)
    stream.clear()
    for group_file in files:
        group_file.file.close()
    if scratch._users > 0:
        scratch.release()


@functools.cache
def disk_stepping(cls: type, tier: DiskTier) -> type:
    """``cls`` with its state on the disk (:class:`DiskStepping`), named as ``cls``.

    Example::

        DiskAdamW = disk_stepping(torch.optim.AdamW, DiskTier("/local_nvme/offload"))
        optimizer = DiskAdamW(model.parameters(), lr=1e-3)
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class=DiskAdamW, lr=1e-3)   # ZeRO-1
    """
    if issubclass(cls, DiskStepping):
        return cls
    attributes = {"_user_class": cls, "_tier": tier, "__module__": __name__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (DiskStepping, cls), attributes)


def disk_step(optimizer: torch.optim.Optimizer, tier: DiskTier, group: Any = None, shard: bool = False,
              schedulers: Any = ()) -> torch.optim.Optimizer:  # fmt: skip
    """``optimizer`` (freshly built) rebuilt with its state on the disk, same groups and defaults
    (``shard``: ZeRO-1 over ``group``, each replica's shard on its own rank's disk); the LR
    ``schedulers`` that drive it follow.

    Raises:
        TypeError: it is no ``torch.optim.Optimizer`` (or already sharded by ZeRO).
        ValueError: it has stepped already, its class has no host step or state the tier cannot stream,
            or the directory is missing, not writable, held by a live process, or on a disk without room
            (the bytes needed and free), or the buffer is too small (the size it needs).

    Example::

        optimizer = disk_step(torch.optim.AdamW(model.parameters()), DiskTier("/local_nvme/offload"))
    """
    if isinstance(getattr(optimizer, "optim", optimizer), DiskStepping):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or zero_sharding.is_sharded(optimizer):
        raise TypeError(
            f"offload_to='disk' rebuilds the optimizer configure_optimizers returns, but got a "
            f"{type(optimizer).__name__}: return a torch.optim.Optimizer"
        )
    if any(optimizer.state.values()):
        raise ValueError(
            f"offload_to='disk' got a {type(optimizer).__name__} that already holds state: offload it right "
            f"after it is built, before its first step"
        )
    cls = disk_stepping(type(optimizer), tier)
    if shard:
        sharded = zero_sharding.shard_optimizer_state(optimizer, group, schedulers, optimizer_class=cls)
        if sharded is not optimizer:
            return sharded
    defaults = accepted_settings(type(optimizer), optimizer.defaults)
    rebuilt = cls([dict(g) for g in optimizer.param_groups], **defaults)
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            zero_sharding.retarget_scheduler(scheduler, rebuilt)
    return rebuilt
