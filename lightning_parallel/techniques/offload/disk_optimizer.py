"""The disk tier: the user's optimizer with its state in files, streamed through a bounded host buffer.

When the host cannot hold the optimizer state either (several ranks of a node sharing its memory), the
state (and the fp32 master of bf16 / fp16 parameters) lives in files under a directory the user names,
one directory per rank (:mod:`~lightning_parallel.techniques.offload.scratch`). Once per optimizer step,
after backward, clipping and unscaling on the device, each chunk of the state
(:mod:`~lightning_parallel.techniques.offload.disk_layout`) is read into a slot of the host buffer while
the previous chunk steps and the one before is written back
(:mod:`~lightning_parallel.techniques.offload.disk_stream`); for each chunk the gradients come down
(pinned and non-blocking on an accelerator), the user's class steps it with its fastest host kernel, and
the updated parameters go up. The numbers are a plain optimizer's: an elementwise step over a chunk is
the step over the whole tensors (fp32 parameters: the device's own values are stepped; bf16 / fp16: the
fp32 master from the file, rounded on the way up).

One class for every data-parallel mode (:func:`disk_stepping`, named as the user's): plain replicas,
ZeRO-1 (``ZeroRedundancyOptimizer(optimizer_class=disk_stepping(cls, tier))`` steps each replica's shard
from its files) and FSDP2 shards (DTensor parameters: their local shards are stepped; the state shows as
DTensors placed as them, :mod:`~lightning_parallel.techniques.offload.host_shards`).

``state_dict()`` reads the state from the files (a checkpoint holds it: the rank's state is on the host
while it is written, as without the tier); ``load_state_dict()`` writes it to them, with the keys, ids
and groups of a plain optimizer (plus ``"fp32_param"`` for a bf16 / fp16 parameter, as
:mod:`~lightning_parallel.techniques.offload.shard_optimizer` does). The files are scratch: made afresh
by each run, removed by :meth:`DiskStepping.close` (the strategy's teardown, a stop), at the
interpreter's exit, and by the kernel on a kill where they are unnamed (Linux ``O_TMPFILE``); a
directory a killed run left is emptied by the next one, which takes its state from the checkpoint.

Integration plan (issue 54, the next phase; the plan fields are one technique's, offload's):

* fields: ``offload="optimizer"`` with ``offload_to="host" | "disk"`` (default ``"host"``),
  ``offload_dir`` (required with ``"disk"``), ``offload_buffer`` (bytes or ``"1GiB"``, default 1 GiB: the
  host's bound per rank). ``check()`` refuses: ``offload_to="disk"`` without ``"optimizer"`` in offload
  ("offload_to='disk' moves the optimizer state: add 'optimizer' to offload"); with ``"parameters"``
  (FSDP2's CPUOffloadPolicy keeps the shards' state on the host: "use offload='optimizer' with
  data_parallel='fsdp'"); ``offload_dir`` missing or given with ``offload_to="host"``; an
  ``offload_buffer`` that is not a positive size; tensor parallelism (as offload already refuses).
  The directory, its room and its writability are checked at set-up on every rank (``agree``), before
  any step, by building the optimizers (:func:`disk_step` raises ``ValueError`` with the values).
* ``optimizers()``: replicas: :func:`disk_step`; ZeRO-1: ``disk_step(..., group=dp_group, shard=True)``;
  FSDP2 / HSDP: :func:`disk_step` over the DTensor shards (and ``host_step_shards`` of
  ``shard_optimizer.py`` for ``offload_to="host"``, replacing today's refusal of optimizer-only offload
  under FSDP2). ``environment()``: the host backend beside the device's (state DTensors on the host).
  The strategy's teardown and stop call ``close()``; a failure of a step (``DiskFullError``) ends the job
  on every rank through ``agree``, the last checkpoint untouched.
* memory: the device loses the state (8 bytes / element for AdamW, its fp32 master for bf16 / fp16);
  the host holds ``offload_buffer`` (three chunk slots and a work area), not the state; a disk column
  per node holds the state (+ masters), summed over the node's ranks, aligned to 4 KiB per chunk.
* time: per optimizer step, the state read and written once at the disk's measured bandwidth (probed
  once, as the host copy is), overlapped with the host step chunk by chunk: ``max(read + write, host
  step) + one chunk``; the gradient and parameter copies as host offload's.
* checkpoints: unchanged paths (``state_dict()`` / ``load_state_dict()``, consolidated or DCP); the
  scratch files are never read at a resume.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.techniques import zero
from lightning_parallel.techniques.offload.disk_layout import (
    SPLIT,
    GroupLayout,
    StateKey,
    plan_group,
    probe_keys,
)
from lightning_parallel.techniques.offload.disk_stream import SLOTS, HostBuffers, Stream
from lightning_parallel.techniques.offload.host_optimizer import (
    _KERNEL_KEYS,
    HOST,
    accepted_defaults,
    host_kernel,
)
from lightning_parallel.techniques.offload.host_shards import host_local, local_view, placed_like
from lightning_parallel.techniques.offload.scratch import ScratchDir, StateFile, check_room
from lightning_parallel.techniques.offload.shard_optimizer import MASTER, master_dtype

_ALIGN = 64
_NOT_HYPER = ("params", "param_names", *_KERNEL_KEYS)  # the host's kernel is its own choice


@dataclass(frozen=True)
class DiskTier:
    """Where and how the disk tier keeps an optimizer's state.

    Args:
        directory: the user's directory (``offload_dir``); each rank uses ``<directory>/rank<R>``.
        buffer_bytes: the host buffer's size: all the host memory the tier holds for the state.
        rank: the directory's rank (default: the global rank, or 0 without a process group).
        pin_memory: page-lock the work area (the device copies then run asynchronously).
        unnamed: unnamed files (``O_TMPFILE``): None where the filesystem has them, False never.

    Example::

        tier = DiskTier("/local_nvme/offload", buffer_bytes=2**30, pin_memory=True)
    """

    directory: str
    buffer_bytes: int = 2**30
    rank: int | None = None
    pin_memory: bool = False
    unnamed: bool | None = None

    def rank_now(self) -> int:
        if self.rank is not None:
            return self.rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class _Spec:
    """A param group's facts before its file is laid out."""

    keys: tuple[StateKey, ...]
    elementwise: bool
    numels: list[int | None]  # None: frozen
    low: list[bool]  # bf16 / fp16: stepped as an fp32 master kept in the file
    dtype: torch.dtype  # what the host steps in (the gradients and the master too)
    param_size: int  # the largest element size of its bf16 / fp16 parameters (the rounding), else 0

    @property
    def state_bytes(self) -> int:  # per element, in a slot
        return sum(k.size for k in self.keys)

    @property
    def work_bytes(self) -> int:  # per element, in the work area: gradient, parameter, rounding
        return 2 * _size(self.dtype) + self.param_size


@dataclass
class _GroupOnDisk:
    """A param group's file and what is known of its state without reading it."""

    spec: _Spec
    layout: GroupLayout
    file: StateFile
    small: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # piece -> step, ...
    masters: set[int] = field(default_factory=set)  # tensors whose master in the file is current
    seen: dict[int, tuple[int, int]] = field(default_factory=dict)  # (version, address) at our last write

    def has_state(self, index: int) -> bool:
        pieces = self.layout.pieces_of(index)
        return bool(pieces) and (index, pieces[0][1].start) in self.small


class DiskStepping:
    """The user's optimizer class with its state in files: mixed in first by :func:`disk_stepping`.

    ``param_groups`` are the user's (device parameters or DTensor shards, hyper-parameters that LR
    schedulers, clipping and the GradScaler read and write); the state is in the files of
    ``<tier.directory>/rank<R>``, one per param group. ``buffers`` counts the host buffers (``peak``:
    the measured bound); ``seconds`` the time in steps and, of it, waiting on the disk.
    """

    _user_class: type
    _tier: DiskTier

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._user_class.__init__(self, params, *args, **kwargs)
        self._step_supports_amp_scaling = False  # the GradScaler unscales the device gradients first
        self._defaults = accepted_defaults(self._user_class, self.defaults)
        self._kernel = host_kernel(self._user_class, self._defaults, torch.float32)
        self._scratch = ScratchDir.acquire(self._tier.directory, self._tier.rank_now())
        self._disk: list[_GroupOnDisk] = []
        self._stream: list[Stream] = []  # (made at the first step, kept: a list so close() shares it)
        try:
            specs = [self._spec(g) for g in self.param_groups]
            self._slot_bytes, self._work_bytes = _buffer_split(specs, self._tier.buffer_bytes)
            self._lay_out(specs)
        except BaseException:
            _close(self._disk, self._stream, self._scratch)
            raise
        self.state = _DiskState(self)
        self.buffers = HostBuffers()
        self.seconds = {"step": 0.0, "waiting": 0.0}
        self._failed: BaseException | None = None
        self._closer = weakref.finalize(self, _close, self._disk, self._stream, self._scratch)

    # ------------------------------------------------------------------------------- the layout
    def _spec(self, group: dict[str, Any]) -> _Spec:
        params = group["params"]
        for p in params:
            if p.requires_grad and not local_view(p).is_contiguous():
                raise ValueError(
                    f"the disk tier writes parameters back by element ranges, but one of shape "
                    f"{tuple(p.shape)} is not contiguous: make it contiguous, or offload to the host"
                )
        trainable = [local_view(p) for p in params if p.requires_grad]
        steps = {master_dtype(t.dtype) for t in trainable}
        if len(steps) > 1:
            raise ValueError(
                f"a param group mixes parameters the host would step in {sorted(map(str, steps))}: put "
                f"them in separate param groups"
            )
        dtype = steps.pop() if steps else torch.float32
        keys, elementwise = probe_keys(self._user_class, group, self._kernel, dtype)
        low = [local_view(p).dtype != dtype for p in params]
        if any(lo and p.requires_grad for lo, p in zip(low, params)):
            keys = (*keys, StateKey(MASTER, dtype))
        numels = [local_view(p).numel() if p.requires_grad else None for p in params]
        param_size = max((t.element_size() for t in trainable if t.dtype != dtype), default=0)
        return _Spec(keys, elementwise, numels, low, dtype, param_size)

    def _lay_out(self, specs: list[_Spec]) -> None:
        layouts = [plan_group(s.numels, s.keys, self._max_elements(s), s.elementwise) for s in specs]
        check_room(self._scratch.path, sum(layout.file_bytes for layout in layouts))
        for spec, layout in zip(specs, layouts):
            file = self._scratch.new_file(layout.file_bytes, self._tier.unnamed)
            self._disk.append(_GroupOnDisk(spec, layout, file))

    def _max_elements(self, spec: _Spec) -> int:
        if not spec.state_bytes:  # (no per-element state: only the work area bounds a chunk)
            return max(1, (self._work_bytes - 3 * _ALIGN) // max(spec.work_bytes, 1))
        by_slot = (self._slot_bytes - _ALIGN * len(spec.keys)) // spec.state_bytes
        by_work = (self._work_bytes - 3 * _ALIGN) // max(spec.work_bytes, 1)
        return max(1, min(by_slot, by_work))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._user_class.add_param_group(self, param_group)
        if "_disk" in self.__dict__:  # (a group added after construction: BackboneFinetuning's)
            self._lay_out([self._spec(self.param_groups[-1])])

    # --------------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's: backward, then clipping and unscaling on the device
            with torch.enable_grad():
                loss = closure()
        if self._failed is not None:
            raise RuntimeError(
                "the disk tier's optimizer failed in an earlier step (its files are partly written): "
                "resume from the last checkpoint"
            ) from self._failed
        start = time.perf_counter()
        self._refresh = self._stale_masters()
        chunks = [
            (g, c) for g, disk in enumerate(self._disk) for c in disk.layout.chunks if self._stepped(g, c)
        ]
        stream = self._open_stream()
        waited = stream.waited
        try:
            stream.run(chunks, self._read, self._step_chunk, self._write)
        except BaseException as err:
            self._failed = err
            raise
        self._note_masters(chunks)
        self.seconds["step"] += time.perf_counter() - start
        self.seconds["waiting"] += stream.waited - waited
        return loss

    def _open_stream(self) -> Stream:
        if not self._stream:
            self._stream.append(
                Stream(self.buffers, self._slot_bytes, self._work_bytes, self._tier.pin_memory)
            )
        return self._stream[0]

    def _stepped(self, g: int, chunk: Any) -> bool:
        params = self.param_groups[g]["params"]
        return any(params[p.index].grad is not None for p in chunk.pieces)

    def _stale_masters(self) -> set[tuple[int, int]]:
        """The bf16 / fp16 tensors whose master must be taken from the device (never stepped, or
        written since by someone else: a checkpoint's weights, a broadcast)."""
        stale = set()
        for g, disk in enumerate(self._disk):
            for i, p in enumerate(self.param_groups[g]["params"]):
                if (
                    disk.spec.low[i]
                    and p.requires_grad
                    and (i not in disk.masters or disk.seen.get(i) != _seen(p))
                ):
                    stale.add((g, i))
        return stale

    def _note_masters(self, chunks: list) -> None:
        for g, chunk in chunks:
            disk, params = self._disk[g], self.param_groups[g]["params"]
            for piece in chunk.pieces:
                if disk.spec.low[piece.index] and params[piece.index].grad is not None:
                    disk.masters.add(piece.index)
                    disk.seen[piece.index] = _seen(params[piece.index])

    def _read(self, item: tuple[int, Any], slot: torch.Tensor) -> None:
        g, chunk = item
        disk = self._disk[g]
        if any((p.index, p.start) in disk.small or p.index in disk.masters for p in chunk.pieces):
            disk.file.read_into(chunk.offset, slot[: chunk.nbytes(disk.spec.keys)])

    def _write(self, item: tuple[int, Any], slot: torch.Tensor) -> None:
        g, chunk = item
        disk = self._disk[g]
        disk.file.write_from(chunk.offset, slot[: chunk.nbytes(disk.spec.keys)])

    def _step_chunk(self, item: tuple[int, Any], slot: torch.Tensor, work: torch.Tensor) -> bool:
        """Gradients down, the host step over the chunk's pieces, parameters up; whether it stepped."""
        g, chunk = item
        disk, group = self._disk[g], self.param_groups[g]
        spec, n = disk.spec, chunk.numel
        views = {
            k.name: _view(slot, chunk.key_offset(spec.keys, j), n, k.dtype) for j, k in enumerate(spec.keys)
        }
        grads = _view(work, 0, n, spec.dtype)
        values = _view(work, _aligned(n * _size(spec.dtype)), n, spec.dtype)
        pieces = [p for p in chunk.pieces if group["params"][p.index].grad is not None]
        stepped = [self._gradient_in(g, p, views, grads, values) for p in pieces]
        if self._tier.pin_memory:  # the host step reads what the device stream is still writing
            torch.accelerator.synchronize()
        hyper = {k: _on_host(v) for k, v in group.items() if k not in _NOT_HYPER}
        host = self._user_class([{**hyper, **self._kernel, "params": stepped}], **self._defaults)
        for tensor, piece in zip(stepped, pieces):
            if (piece.index, piece.start) in disk.small:
                host.state[tensor] = {
                    **_slices(views, piece, spec.keys),
                    **disk.small[(piece.index, piece.start)],
                }
        host.step()
        for tensor, piece in zip(stepped, pieces):
            self._keep_state(disk, piece, host.state[tensor], views)
            tensor.grad = None
        rounding = work[2 * _aligned(n * _size(spec.dtype)) :]
        for tensor, piece in zip(stepped, pieces):
            self._parameter_out(group["params"][piece.index], piece, tensor, rounding)
        return bool(pieces)

    def _gradient_in(
        self, g: int, piece: Any, views: dict, grads: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """The piece's gradient into the work area, and the tensor the host steps (its master, or its
        value copied from the device)."""
        param = self.param_groups[g]["params"][piece.index]
        span = slice(piece.at, piece.at + piece.numel)
        device = _flat(local_view(param))[piece.start : piece.start + piece.numel]
        grad = _flat(local_view(param.grad))[piece.start : piece.start + piece.numel]
        non_blocking = self._tier.pin_memory
        grads[span].copy_(grad, non_blocking=non_blocking)
        if self._disk[g].spec.low[piece.index]:
            tensor = views[MASTER][span]
            if (g, piece.index) in self._refresh:
                tensor.copy_(device, non_blocking=non_blocking)
        else:
            tensor = values[span].copy_(device, non_blocking=non_blocking)
        tensor.grad = grads[span]
        return tensor

    def _keep_state(self, disk: _GroupOnDisk, piece: Any, state: dict[str, Any], views: dict) -> None:
        """The step's state of a piece: the per-element tensors in the slot (a first step made them
        elsewhere: copied in), the rest (``step``) kept in memory."""
        names = {k.name for k in disk.spec.keys if k.name != MASTER}
        per_element = {k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
        if per_element != names:
            raise RuntimeError(
                f"{self._user_class.__name__}'s state has the keys {sorted(per_element)} but the disk tier "
                f"laid out {sorted(names)} (found by a probe step): its state changed with a hyper-parameter "
                f"(amsgrad?): build the optimizer with its final settings"
            )
        if not state:
            return  # (no state kept for it: SGD without momentum)
        key = (piece.index, piece.start)
        if key not in disk.small:
            for name, tensor in _slices(views, piece, disk.spec.keys).items():
                tensor.copy_(state[name])
        disk.small[key] = {k: v for k, v in state.items() if k not in per_element}

    def _parameter_out(
        self, param: torch.Tensor, piece: Any, tensor: torch.Tensor, rounding: torch.Tensor
    ) -> None:
        device = _flat(local_view(param))[piece.start : piece.start + piece.numel]
        if device.dtype != tensor.dtype:  # bf16 / fp16: rounded on the host, half the bytes up
            tensor = _view(rounding, piece.at * device.dtype.itemsize, piece.numel, device.dtype).copy_(
                tensor
            )
        device.copy_(tensor, non_blocking=self._tier.pin_memory)

    # --------------------------------------------------------------------------- the state dict
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Write a state dict (a plain optimizer's layout, or this one's) into the files."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "the loaded optimizer state has other param groups than this optimizer (sizes "
                f"{[len(g['params']) for g in saved_groups]} against "
                f"{[len(g['params']) for g in self.param_groups]}): resume with the same param grouping"
            )
        params = {}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            params.update(zip(saved["params"], group["params"]))
        for param in list(self.state):
            del self.state[param]
        for pid, values in state_dict["state"].items():
            self.state[params[pid]] = values

    def close(self) -> None:
        """Stop the threads, free the buffers, remove the files (and the rank's directory if no other
        optimizer uses it). The optimizer cannot step afterwards."""
        if self._closer.detach() is not None:  # (the first close: the finalizer will not run)
            _close(self._disk, self._stream, self._scratch, wait=True)

    def disk_bytes(self) -> int:
        """Bytes of this optimizer's files (reserved when it was built)."""
        return sum(d.layout.file_bytes for d in self._disk)


class _DiskState(MutableMapping):
    """The user-facing ``optimizer.state``: each parameter's state read from the files when asked (shown
    as DTensors placed as a DTensor parameter), written to them when set."""

    def __init__(self, owner: DiskStepping) -> None:
        self._owner = weakref.proxy(owner)  # (no cycle: a dropped optimizer is freed, its files closed)
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group, position): groups only grow

    def _where(self, param: Any) -> tuple[int, int]:
        groups = self._owner.param_groups
        if id(param) not in self._index:
            self._index = {
                id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"])
            }
        g, i = self._index.get(id(param), (-1, -1))
        if g < 0 or groups[g]["params"][i] is not param:
            raise KeyError(param)
        return g, i

    def __getitem__(self, param: Any) -> dict[str, Any]:
        g, i = self._where(param)
        disk = self._owner._disk[g]
        if not disk.has_state(i):
            raise KeyError(param)
        shape = local_view(param).shape
        state: dict[str, Any] = {
            k: _on_host(v, clone=True)
            for k, v in disk.small[(i, disk.layout.pieces_of(i)[0][1].start)].items()
        }
        for j, key in enumerate(disk.spec.keys):
            if key.name == MASTER and not (disk.spec.low[i] and i in disk.masters):
                continue
            full = torch.empty(shape.numel(), dtype=key.dtype)
            for chunk, piece in disk.layout.pieces_of(i):
                at = chunk.offset + chunk.key_offset(disk.spec.keys, j) + piece.at * key.size
                disk.file.read_into(at, full[piece.start : piece.start + piece.numel])
            state[key.name] = placed_like(full.view(shape), param)
        return state

    def __setitem__(self, param: Any, value: dict[str, Any]) -> None:
        g, i = self._where(param)
        disk = self._owner._disk[g]
        pieces = disk.layout.pieces_of(i)
        if not pieces:
            raise ValueError(
                "optimizer state was given for a parameter that was frozen when the optimizer was built "
                "(the disk tier has no room for it): build the optimizer after unfreezing, or add the "
                "parameter as a new param group"
            )
        value = dict(value)
        master = value.pop(MASTER, None)
        for j, key in enumerate(disk.spec.keys):
            if key.name == MASTER:
                continue
            if key.name not in value:
                raise ValueError(
                    f"the loaded optimizer state has no {key.name!r} for a parameter: resume with the same "
                    f"optimizer settings"
                )
            flat = host_local(value.pop(key.name), param, key.dtype).reshape(-1).contiguous()
            for chunk, piece in pieces:
                at = chunk.offset + chunk.key_offset(disk.spec.keys, j) + piece.at * key.size
                disk.file.write_from(at, flat[piece.start : piece.start + piece.numel])
        disk.masters.discard(i)
        if master is not None and disk.spec.low[i]:
            self._take_master(disk, i, param, pieces, host_local(master, param, disk.spec.dtype))
        for _, piece in pieces:
            disk.small[(i, piece.start)] = {k: _small(k, v) for k, v in value.items()}

    def _take_master(
        self, disk: _GroupOnDisk, i: int, param: Any, pieces: list, master: torch.Tensor
    ) -> None:
        """A loaded master is taken if it rounds to the parameter as it is now (else: from the parameter)."""
        device = local_view(param)
        if not torch.equal(master.to(device.dtype), device.to(HOST)):
            return
        j = len(disk.spec.keys) - 1
        flat = master.reshape(-1).contiguous()
        for chunk, piece in pieces:
            at = chunk.offset + chunk.key_offset(disk.spec.keys, j) + piece.at * disk.spec.dtype.itemsize
            disk.file.write_from(at, flat[piece.start : piece.start + piece.numel])
        disk.masters.add(i)
        disk.seen[i] = _seen(param)

    def __delitem__(self, param: Any) -> None:
        g, i = self._where(param)
        disk = self._owner._disk[g]
        if not disk.has_state(i):
            raise KeyError(param)
        for _, piece in disk.layout.pieces_of(i):
            disk.small.pop((i, piece.start), None)
        disk.masters.discard(i)

    def __iter__(self) -> Iterator[Any]:
        for g, group in enumerate(self._owner.param_groups):
            yield from (p for i, p in enumerate(group["params"]) if self._owner._disk[g].has_state(i))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# ----------------------------------------------------------------------------------- small helpers
def _close(disks: list[_GroupOnDisk], stream: list[Stream], scratch: ScratchDir, wait: bool = False) -> None:
    """Release what an optimizer holds; also its finalizer (``wait`` False: see ``Stream.close``)."""
    for s in stream:
        s.close(wait=wait)
    stream.clear()
    for disk in disks:
        disk.file.close()
    if scratch._users > 0:
        scratch.release()


def _buffer_split(specs: list[_Spec], buffer_bytes: int) -> tuple[int, int]:
    """(a slot's bytes, the work area's bytes): ``SLOTS`` slots and the work area fill the buffer.

    Raises:
        ValueError: the buffer holds fewer than ``SPLIT`` elements per chunk, with the size it needs.
    """
    state = max((s.state_bytes for s in specs), default=0)
    work = max((s.work_bytes for s in specs), default=8)
    keys = max((len(s.keys) for s in specs), default=0)
    slack = SLOTS * _ALIGN * keys + 3 * _ALIGN
    elements = (buffer_bytes - slack) // (SLOTS * state + work)
    if elements < SPLIT:
        raise ValueError(
            f"the disk tier's host buffer of {buffer_bytes} bytes holds {max(elements, 0)} elements per "
            f"chunk ({SLOTS} slots of {state} bytes and a work area of {work} bytes per element), fewer than "
            f"{SPLIT}: use a buffer of at least {slack + SPLIT * (SLOTS * state + work)} bytes (a few "
            f"hundred MiB keeps the disk busy)"
        )
    return elements * state + _ALIGN * keys, elements * work + 3 * _ALIGN


def _seen(param: torch.Tensor) -> tuple[int, int]:
    shard = local_view(param)
    return shard._version, shard.data_ptr()


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _view(buffer: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return buffer[offset : offset + numel * dtype.itemsize].view(dtype)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def _slices(
    views: dict[str, torch.Tensor], piece: Any, keys: tuple[StateKey, ...]
) -> dict[str, torch.Tensor]:
    span = slice(piece.at, piece.at + piece.numel)
    return {k.name: views[k.name][span] for k in keys if k.name != MASTER}


def _on_host(value: Any, clone: bool = False) -> Any:
    if not torch.is_tensor(value):
        return value
    value = value.detach().to(HOST)
    return value.clone() if clone else value


def _small(key: str, value: Any) -> Any:
    """A loaded 0-dim state value as the host step keeps it (its own copy: each piece steps its own)."""
    if key == "step":
        return torch.tensor(float(value), dtype=torch.float32)
    return _on_host(value, clone=True)


def disk_stepping(cls: type, tier: DiskTier) -> type:
    """``cls`` with its state on the disk (:class:`DiskStepping`), named as ``cls``.

    Example::

        DiskAdamW = disk_stepping(torch.optim.AdamW, DiskTier("/local_nvme/offload"))
        optimizer = DiskAdamW(model.parameters(), lr=1e-3)
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class=DiskAdamW, lr=1e-3)   # ZeRO-1
    """
    if issubclass(cls, DiskStepping):
        return cls
    key = (cls, tier)
    if key not in _CLASSES:
        attributes = {
            "_user_class": cls,
            "_tier": tier,
            "__module__": __name__,
            "__qualname__": cls.__qualname__,
        }
        _CLASSES[key] = type(cls.__name__, (DiskStepping, cls), attributes)
    return _CLASSES[key]


_CLASSES: dict[tuple[type, DiskTier], type] = {}


def disk_step(optimizer: torch.optim.Optimizer, tier: DiskTier, group: Any = None, shard: bool = False,
              schedulers: Any = ()) -> torch.optim.Optimizer:  # fmt: skip
    """``optimizer`` (freshly built) rebuilt with its state on the disk, same groups and defaults
    (``shard``: ZeRO-1 over ``group``, each replica's shard on its own rank's disk); the LR
    ``schedulers`` that drive it follow.

    Raises:
        TypeError: it is no ``torch.optim.Optimizer`` (or already sharded by ZeRO).
        ValueError: it has stepped already, its class has no host step or state the tier cannot stream,
            or the directory is missing, not writable, or on a disk without room (the bytes needed and
            free).

    Example::

        optimizer = disk_step(torch.optim.AdamW(model.parameters()), DiskTier("/local_nvme/offload"))
    """
    if isinstance(getattr(optimizer, "optim", optimizer), DiskStepping):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or zero.is_sharded(optimizer):
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
        sharded = zero.shard_optimizer_state(optimizer, group, schedulers, optimizer_class=cls)
        if sharded is not optimizer:
            return sharded
    rebuilt = cls(
        [dict(g) for g in optimizer.param_groups], **accepted_defaults(type(optimizer), optimizer.defaults)
    )
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            zero.retarget_scheduler(scheduler, rebuilt)
    return rebuilt
