"""One chunk of a disk-stepping optimizer's step: gradients down, the host step, parameters up.

The chunk's state is in a slot of the host buffer (read from the file, one region per state key); the
work area holds, per element of the chunk, the gradient, the parameter's value (fp32 parameters: copied
from the device; bf16 / fp16 ones step their fp32 master, which is in the slot) and the rounding of a
bf16 / fp16 master on its way up. The user's class steps the chunk's pieces as tensors of their own, with
the state the file had for them (a piece stepping for the first time: the class makes its state, which
is copied into the slot; the class's own initialisation, since a zero state is not every class's first
state: SGD's momentum starts as the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_parallel.techniques.offload.disk_group import GroupFile
from lightning_parallel.techniques.offload.disk_layout import Chunk, Piece, StateKey
from lightning_parallel.techniques.offload.host_optimizer import _KERNEL_KEYS, HOST
from lightning_parallel.techniques.offload.host_shards import local_view
from lightning_parallel.techniques.offload.shard_optimizer import MASTER

ALIGN = 64  # bytes: where each region of the work area starts
WORK_REGIONS = 3  # gradients, values, roundings
_NOT_HYPER = ("params", "param_names", *_KERNEL_KEYS)  # the host's kernel is its own choice


@dataclass(frozen=True)
class ChunkStep:
    """Steps one chunk of a group with the user's class ``cls`` and the host ``kernel``.

    Example::

        stepper = ChunkStep(torch.optim.AdamW, {"fused": True}, {"lr": 1e-3}, pin_memory=False)
        stepped = stepper(optimizer.param_groups[0], group_file, chunk, slot, work, refresh=set())
    """

    cls: type
    kernel: dict[str, Any]
    defaults: dict[str, Any]
    pin_memory: bool

    def __call__(self, group: dict[str, Any], group_file: GroupFile, chunk: Chunk, slot: torch.Tensor,
                 work: torch.Tensor, refresh: set[int]) -> bool:  # fmt: skip
        """Step the chunk's pieces that have gradients (``refresh``: tensors whose master is taken from
        the device first); whether any did (then the slot is to be written back)."""
        spec, params, n = group_file.spec, group["params"], chunk.numel
        views = {
            k.name: view(slot, chunk.key_offset(spec.keys, j), n, k.dtype) for j, k in enumerate(spec.keys)
        }
        grads = view(work, 0, n, spec.dtype)
        values = view(work, aligned(n * spec.dtype.itemsize), n, spec.dtype)
        pieces = [p for p in chunk.pieces if params[p.index].grad is not None]
        stepped = [
            self._gradient_in(params[p.index], p, group_file, views, grads, values, refresh) for p in pieces
        ]
        if self.pin_memory:  # the host step reads what the device stream is still writing
            torch.accelerator.synchronize()
        hyper = {k: _on_host(v) for k, v in group.items() if k not in _NOT_HYPER}
        host = self.cls([{**hyper, **self.kernel, "params": stepped}], **self.defaults)
        for tensor, piece in zip(stepped, pieces):
            host.state[tensor] = _state_in_slot(group_file, piece, views)
        host.step()
        for tensor, piece in zip(stepped, pieces):
            self._keep_state(group_file, piece, host.state[tensor], views)
            tensor.grad = None
        rounding = work[2 * aligned(n * spec.dtype.itemsize) :]
        for tensor, piece in zip(stepped, pieces):
            self._parameter_out(params[piece.index], piece, tensor, rounding)
        return bool(pieces)

    def _gradient_in(
        self,
        param: torch.Tensor,
        piece: Piece,
        group_file: GroupFile,
        views: dict,
        grads: torch.Tensor,
        values: torch.Tensor,
        refresh: set[int],
    ) -> torch.Tensor:
        """The piece's gradient into the work area; the tensor the host steps (the master in the slot,
        or the value copied from the device into the work area)."""
        span = slice(piece.at, piece.at + piece.numel)
        device = _piece_of(local_view(param), piece)
        grads[span].copy_(_piece_of(local_view(param.grad), piece), non_blocking=self.pin_memory)
        if group_file.spec.low[piece.index]:
            tensor = views[MASTER][span]
            if piece.index in refresh:
                tensor.copy_(device, non_blocking=self.pin_memory)
        else:
            tensor = values[span].copy_(device, non_blocking=self.pin_memory)
        tensor.grad = grads[span]
        return tensor

    def _keep_state(self, group_file: GroupFile, piece: Piece, state: dict[str, Any], views: dict) -> None:
        """The piece's state after the step: the per-element tensors in the slot (a first step made them
        elsewhere: copied in), the rest (``step``) kept in memory.

        Raises:
            RuntimeError: the class made other per-element state than the probe step did.
        """
        names = {k.name for k in group_file.spec.keys if k.name != MASTER}
        per_element = {k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
        if per_element != names:
            raise RuntimeError(
                f"{self.cls.__name__}'s state has the keys {sorted(per_element)} but the disk tier laid out "
                f"{sorted(names)} (found by a probe step): its state changed with a hyper-parameter "
                f"(amsgrad?): build the optimizer with its final settings"
            )
        if not state:
            return  # (no state kept for it: SGD without momentum)
        key = (piece.index, piece.start)
        if key not in group_file.small:
            for name, tensor in _slices(views, piece, group_file.spec.keys).items():
                if state[name].data_ptr() != tensor.data_ptr():  # (made by the class, not in the slot)
                    tensor.copy_(state[name])
        group_file.small[key] = {k: v for k, v in state.items() if k not in per_element}

    def _parameter_out(
        self, param: torch.Tensor, piece: Piece, tensor: torch.Tensor, rounding: torch.Tensor
    ) -> None:
        device = _piece_of(local_view(param), piece)
        if device.dtype != tensor.dtype:  # bf16 / fp16: rounded on the host, half the bytes go up
            tensor = view(rounding, piece.at * device.dtype.itemsize, piece.numel, device.dtype).copy_(tensor)
        device.copy_(tensor, non_blocking=self.pin_memory)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def view(buffer: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of a byte buffer."""
    return buffer[offset : offset + numel * dtype.itemsize].view(dtype)


def _piece_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    return tensor.reshape(-1)[piece.start : piece.start + piece.numel]


def _slices(
    views: dict[str, torch.Tensor], piece: Piece, keys: tuple[StateKey, ...]
) -> dict[str, torch.Tensor]:
    span = slice(piece.at, piece.at + piece.numel)
    return {k.name: views[k.name][span] for k in keys if k.name != MASTER}


def _state_in_slot(group_file: GroupFile, piece: Piece, views: dict) -> dict[str, Any]:
    """The piece's state for the host step, its per-element tensors the slot's: as the file had it, or
    (stepping for the first time, where the class starts from zeros: ``GroupSpec.start``) zeroed there,
    so the class makes no chunk of state outside the buffer; else empty: the class makes its own."""
    key, spec = (piece.index, piece.start), group_file.spec
    if key in group_file.small:
        return {**_slices(views, piece, spec.keys), **group_file.small[key]}
    if spec.start is None:
        return {}
    slices = _slices(views, piece, spec.keys)
    for tensor in slices.values():
        tensor.zero_()
    return {**slices, **{k: v.clone() for k, v in spec.start.items()}}


def _on_host(value: Any) -> Any:
    return value.detach().to(HOST) if torch.is_tensor(value) else value
