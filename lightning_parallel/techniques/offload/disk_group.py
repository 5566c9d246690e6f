"""A param group on the disk: its facts, its file, and each parameter's state read from or written to it.

:func:`group_spec` gathers what a group's file needs (the per-element state keys of the optimizer class,
the trainable tensors' sizes, which ones are bf16 / fp16 and so keep an fp32 master in the file);
:class:`GroupFile` is the file laid out (:mod:`~lightning_parallel.techniques.offload.disk_layout`) with
what is known of the state without reading it (the pieces that have state, their ``step``, the masters
that are current); :class:`DiskState` is the optimizer's ``state`` mapping over its groups' files (what
``state_dict()``, DCP and ZeRO-1 read and write).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_parallel.techniques.offload.disk_layout import GroupLayout, StateKey, probe_keys, probe_start
from lightning_parallel.techniques.offload.host_optimizer import HOST
from lightning_parallel.techniques.offload.host_shards import host_local, local_view, placed_like, written
from lightning_parallel.techniques.offload.scratch import StateFile
from lightning_parallel.techniques.offload.shard_optimizer import MASTER, master_dtype


@dataclass
class GroupSpec:
    """A param group's facts before its file is laid out.

    Example::

        spec = group_spec(torch.optim.AdamW, optimizer.param_groups[0], {"fused": True})
        spec.state_bytes   # 8: exp_avg and exp_avg_sq in fp32, per element
    """

    keys: tuple[StateKey, ...]  # per-element state in the file (the fp32 master last, if any)
    elementwise: bool  # tensors may be split between chunks
    numels: list[int | None]  # each tensor's (local) elements; None: frozen
    low: list[bool]  # bf16 / fp16: stepped as an fp32 master kept in the file
    dtype: torch.dtype  # what the host steps in (the gradients and the masters too)
    param_size: int  # the largest element size of its bf16 / fp16 parameters (the rounding), else 0
    start: dict[str, Any] | None = None  # a first state's non-per-element part, where it starts at zeros

    @property
    def state_bytes(self) -> int:
        """Bytes per element in a chunk slot."""
        return sum(k.size for k in self.keys)

    @property
    def work_bytes(self) -> int:
        """Bytes per element in the work area: the gradient, the parameter, its rounding."""
        return 2 * self.dtype.itemsize + self.param_size


def group_spec(cls: type, group: dict[str, Any], kernel: dict[str, Any]) -> GroupSpec:
    """What the file of ``group`` (of an optimizer of class ``cls``, stepped with ``kernel``) holds.

    Raises:
        ValueError: a trainable tensor is not contiguous, the group mixes step dtypes (fp32 with fp64),
            or the class keeps state the tier cannot stream (:func:`probe_keys`).
    """
    params = group["params"]
    trainable = [local_view(p) for p in params if p.requires_grad]
    for t in trainable:
        if not t.is_contiguous():
            raise ValueError(
                f"the disk tier writes parameters back by element ranges, but one of shape "
                f"{tuple(t.shape)} is not contiguous: make it contiguous, or offload to the host"
            )
    steps = {master_dtype(t.dtype) for t in trainable}
    if len(steps) > 1:
        raise ValueError(
            f"a param group mixes parameters the host would step in {sorted(map(str, steps))}: put them "
            f"in separate param groups"
        )
    dtype = steps.pop() if steps else torch.float32
    keys, elementwise = probe_keys(cls, group, kernel, dtype)
    low = [local_view(p).dtype != dtype for p in params]
    if any(lo and p.requires_grad for lo, p in zip(low, params)):
        keys = (*keys, StateKey(MASTER, dtype))
    numels = [local_view(p).numel() if p.requires_grad else None for p in params]
    param_size = max((t.element_size() for t in trainable if t.dtype != dtype), default=0)
    start = probe_start(cls, group, kernel, dtype) if keys else None
    return GroupSpec(keys, elementwise, numels, low, dtype, param_size, start)


@dataclass
class GroupFile:
    """A param group's file and what is known of its state without reading it.

    Example::

        state = group_file.read_state(3, param)       # exp_avg, exp_avg_sq, step (and fp32_param)
        group_file.write_state(3, param, state)
    """

    spec: GroupSpec
    layout: GroupLayout
    file: StateFile
    small: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # piece -> step, ...
    masters: set[int] = field(default_factory=set)  # tensors whose master in the file is current
    seen: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # written() at our last write

    def has_state(self, index: int) -> bool:
        pieces = self.layout.pieces_of(index)
        return bool(pieces) and (index, pieces[0][1].start) in self.small

    def read_state(self, index: int, param: torch.Tensor) -> dict[str, Any]:
        """Tensor ``index``'s state, read from the file into new host tensors (DTensors for a DTensor)."""
        pieces = self.layout.pieces_of(index)
        shape = local_view(param).shape
        state = {k: _on_host(v, clone=True) for k, v in self.small[(index, pieces[0][1].start)].items()}
        for j, key in enumerate(self.spec.keys):
            if key.name == MASTER and index not in self.masters:
                continue
            full = torch.empty(shape.numel(), dtype=key.dtype)
            for chunk, piece in pieces:
                at = chunk.offset + chunk.key_offset(self.spec.keys, j) + piece.at * key.size
                self.file.read_into(at, full[piece.start : piece.start + piece.numel])
            state[key.name] = placed_like(full.view(shape), param)
        return state

    def write_state(self, index: int, param: torch.Tensor, value: dict[str, Any]) -> None:
        """Write tensor ``index``'s state (a checkpoint's: DTensors, full or local tensors) to the file.

        Raises:
            ValueError: the parameter was frozen when the file was laid out, or the state's per-element
                keys are not the optimizer's (another optimizer or another ``amsgrad``).
        """
        pieces = self.layout.pieces_of(index)
        if not pieces:
            raise ValueError(
                "optimizer state was given for a parameter that was frozen when the optimizer was built "
                "(the disk tier has no room for it): build the optimizer after unfreezing, or add the "
                "parameter as a new param group"
            )
        value = dict(value)
        master = value.pop(MASTER, None)
        names = [k.name for k in self.spec.keys if k.name != MASTER]
        # (by name: a 0-dim parameter's exp_avg is 0-dim too)
        extra = [k for k, v in value.items() if k not in names and torch.is_tensor(v) and v.dim() > 0]
        if extra or any(n not in value for n in names):
            raise ValueError(
                f"the loaded optimizer state keeps {sorted(value)} for a parameter but this optimizer keeps "
                f"{sorted(names)} per element: resume with the same optimizer and settings"
            )
        for j, key in enumerate(self.spec.keys):
            if key.name != MASTER:
                self._write_key(j, pieces, host_local(value.pop(key.name), param, key.dtype))
        self.masters.discard(index)
        if master is not None and self.spec.low[index]:
            self._take_master(index, param, pieces, host_local(master, param, self.spec.dtype))
        for _, piece in pieces:
            self.small[(index, piece.start)] = {k: _small(k, v) for k, v in value.items()}

    def forget(self, index: int) -> None:
        """Tensor ``index`` has no state any more (its bytes in the file are left, unread)."""
        for _, piece in self.layout.pieces_of(index):
            self.small.pop((index, piece.start), None)
        self.masters.discard(index)

    def _write_key(self, j: int, pieces: list, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).contiguous()
        for chunk, piece in pieces:
            at = chunk.offset + chunk.key_offset(self.spec.keys, j) + piece.at * self.spec.keys[j].size
            self.file.write_from(at, flat[piece.start : piece.start + piece.numel])

    def _take_master(self, index: int, param: Any, pieces: list, master: torch.Tensor) -> None:
        """A loaded master is taken if it rounds to the parameter as it is now (else: from the parameter)."""
        device = local_view(param)
        if torch.equal(master.to(device.dtype), device.to(HOST)):
            self._write_key(len(self.spec.keys) - 1, pieces, master)
            self.masters.add(index)
            self.seen[index] = seen(param)


class DiskState(MutableMapping):
    """The user-facing ``optimizer.state`` of a disk-stepping optimizer ``owner`` (its ``param_groups``
    and ``_disk``, one :class:`GroupFile` per group): each parameter's state read from the files when
    asked, written to them when set.

    Example::

        optimizer.state[param]["exp_avg"]          # read from the file (a DTensor for a DTensor param)
        optimizer.state[param] = loaded_state      # written to it (ZeRO-1's load_state_dict does this)
    """

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.proxy(owner)  # (no cycle: a dropped optimizer is freed, its files closed)
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group, position): groups only grow

    def _where(self, param: Any) -> tuple[GroupFile, int]:
        groups = self._owner.param_groups
        if id(param) not in self._index:
            self._index = {
                id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"])
            }
        g, i = self._index.get(id(param), (-1, -1))
        if g < 0 or groups[g]["params"][i] is not param:
            raise KeyError(param)
        return self._owner._disk[g], i

    def __getitem__(self, param: Any) -> dict[str, Any]:
        group_file, i = self._where(param)
        if not group_file.has_state(i):
            raise KeyError(param)
        return group_file.read_state(i, param)

    def __setitem__(self, param: Any, value: dict[str, Any]) -> None:
        group_file, i = self._where(param)
        group_file.write_state(i, param, value)

    def __delitem__(self, param: Any) -> None:
        group_file, i = self._where(param)
        if not group_file.has_state(i):
            raise KeyError(param)
        group_file.forget(i)

    def __iter__(self) -> Iterator[Any]:
        for group, group_file in zip(self._owner.param_groups, self._owner._disk):
            yield from (p for i, p in enumerate(group["params"]) if group_file.has_state(i))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def seen(param: torch.Tensor) -> tuple[int, int, int]:
    """What changes when something writes ``param`` (:func:`~.host_shards.written`)."""
    return written(param)


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
