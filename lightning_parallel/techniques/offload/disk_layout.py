"""Where the disk tier keeps each parameter's optimizer state: its state keys, chunks and their bytes.

Plans are data: a param group's :class:`GroupLayout` is computed once (from the parameters' sizes, the
optimizer class's state keys found by a probe step, and the host buffer's size) and can be printed and
compared without a file or a process.

A group's trainable tensors (an FSDP2 rank: its local shards), flattened and laid end to end, are cut
into :class:`Chunk` s of at most ``max_elements`` elements; a tensor that does not fit in the chunk being
filled is split (:class:`Piece`: a range of its elements) when the optimizer's step is elementwise
(torch's Adam, AdamW, SGD, ...: a range steps as the whole tensor does), or starts the next chunk
otherwise. In the group's file each chunk is one contiguous region (one read and one write per step),
holding for each per-element state key (``exp_avg``, ``exp_avg_sq``, ...; the fp32 master of a bf16 /
fp16 parameter last) the chunk's elements in a row. Chunks start on a 4 KiB boundary, keys on 64 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_parallel.optim.settings import accepted_settings

# torch.optim classes whose step is elementwise (a tensor's element range steps as the whole tensor).
ELEMENTWISE = frozenset(
    {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop"}
)
_KEY_ALIGN, _CHUNK_ALIGN = 64, 4096
# A tensor is split only at multiples of SPLIT elements. torch's fused CPU kernels (Adam, AdamW, SGD,
# Adagrad) work on 64-byte lines and step each run with SIMD registers then a scalar tail: a piece that
# starts at a multiple of 64 elements and (unless it ends the tensor) spans a multiple of 64 puts every
# element on the same path as the whole tensor does, so the numbers are bitwise the whole-tensor step's.
SPLIT = 64
_PROBE_SHAPE = (2, 3)


@dataclass(frozen=True)
class StateKey:
    """A per-element state tensor of the optimizer (shaped as its parameter) and its dtype."""

    name: str
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of the flattened tensor ``index`` of its param group, at
    element ``at`` of its chunk."""

    index: int
    start: int
    numel: int
    at: int


@dataclass(frozen=True)
class Chunk:
    """What one step reads, steps and writes back at once: its pieces and its region of the file."""

    pieces: tuple[Piece, ...]
    offset: int  # bytes into the group's file
    numel: int

    def key_offset(self, keys: Sequence[StateKey], key: int) -> int:
        """Bytes from the chunk's start to the elements of ``keys[key]``."""
        return sum(_align(self.numel * k.size, _KEY_ALIGN) for k in keys[:key])

    def nbytes(self, keys: Sequence[StateKey]) -> int:
        return self.key_offset(keys, len(keys))


@dataclass(frozen=True)
class GroupLayout:
    """A param group's file: its per-element state keys, its chunks, its size.

    Example::

        >>> layout = plan_group([150, None, 40], (StateKey("exp_avg", torch.float32),), 100, split=True)
        >>> [[(p.index, p.start, p.numel) for p in c.pieces] for c in layout.chunks]
        [[(0, 0, 64)], [(0, 64, 86)], [(2, 0, 40)]]
        >>> layout.file_bytes
        8384
    """

    keys: tuple[StateKey, ...]
    chunks: tuple[Chunk, ...]

    @property
    def file_bytes(self) -> int:
        last = self.chunks[-1] if self.chunks else None
        return last.offset + last.nbytes(self.keys) if last is not None else 0

    def pieces_of(self, index: int) -> list[tuple[Chunk, Piece]]:
        """Where tensor ``index``'s elements are, in order."""
        return [(c, p) for c in self.chunks for p in c.pieces if p.index == index]


def plan_group(numels: Sequence[int | None], keys: Sequence[StateKey], max_elements: int,
               split: bool) -> GroupLayout:  # fmt: skip
    """The chunks of a group whose tensors have ``numels`` elements (None: frozen, no state).

    Raises:
        ValueError: a tensor is larger than ``max_elements`` and the step cannot be split (``split``
            False), with the buffer size it needs.
    """
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    filled, offset = 0, 0

    def close() -> None:
        nonlocal pieces, filled, offset
        if pieces:
            chunk = Chunk(tuple(pieces), offset, filled)
            chunks.append(chunk)
            offset = _align(offset + chunk.nbytes(keys), _CHUNK_ALIGN)
        pieces, filled = [], 0

    if split and max_elements < SPLIT:
        raise ValueError(
            f"the disk tier's host buffer holds {max_elements} elements per chunk, fewer than the "
            f"{SPLIT} a split tensor needs: raise the buffer"
        )
    for index, numel in enumerate(numels):
        if numel is None:
            continue
        if not split and numel > max_elements:
            raise ValueError(
                f"a parameter of {numel} elements does not fit in the disk tier's host buffer, which holds "
                f"{max_elements} elements per chunk, and this optimizer's step cannot be split: raise the "
                f"buffer to {numel / max(max_elements, 1):.1f}x its size, or offload to the host"
            )
        if not split and filled + numel > max_elements:
            close()
        start = 0
        while True:
            take = min(numel - start, max_elements - filled)
            if take < numel - start:  # a split: at a multiple of SPLIT elements (see SPLIT)
                take -= take % SPLIT
                if take == 0:
                    close()
                    continue
            pieces.append(Piece(index, start, take, filled))
            filled, start = filled + take, start + take
            if start >= numel:
                break
            close()
        if filled >= max_elements:
            close()
    close()
    return GroupLayout(tuple(keys), tuple(chunks))


def probe_keys(cls: type, group: dict[str, Any], kernel: dict[str, Any], dtype: torch.dtype) -> tuple[
    tuple[StateKey, ...], bool
]:  # fmt: skip
    """The per-element state keys of ``cls`` for a param group like ``group`` (its hyper-parameters)
    stepped in ``dtype``, found by one step on a small host tensor; and whether its step is elementwise.

    Raises:
        ValueError: the class keeps a state tensor shaped otherwise than its parameter (Adafactor's
            factored moments): the disk tier cannot stream it, with the fix.

    Example::

        >>> keys, elementwise = probe_keys(torch.optim.AdamW, {"lr": 0.1}, {"fused": True}, torch.float32)
        >>> [k.name for k in keys], elementwise
        (['exp_avg', 'exp_avg_sq'], True)
    """
    param = torch.zeros(_PROBE_SHAPE, dtype=dtype, requires_grad=True)
    param.grad = torch.full_like(param, 0.5)
    hyper = accepted_settings(cls, group)
    optimizer = cls([param], **{**hyper, **kernel})
    optimizer.step()
    keys = []
    for name, value in optimizer.state[param].items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        if value.shape != param.shape:
            raise ValueError(
                f"the disk tier streams optimizer state shaped as each parameter, but {cls.__name__} keeps "
                f"{name!r} of shape {tuple(value.shape)} for a parameter of shape {_PROBE_SHAPE}: offload "
                f"its state to the host instead"
            )
        keys.append(StateKey(name, value.dtype))
    elementwise = cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE
    return tuple(keys), elementwise


def probe_start(cls: type, group: dict[str, Any], kernel: dict[str, Any], dtype: torch.dtype) -> dict[
    str, Any
] | None:  # fmt: skip
    """The state ``cls`` starts a tensor from, where its per-element part is zeros: the rest of it (a zero
    ``step``); None where the class starts otherwise (SGD's momentum with dampening starts as the
    gradient). Found by two steps on a small host tensor from the class's own start and from zeros,
    compared bitwise: the disk tier then makes a first state in the buffer's slot (zeroed) instead of
    letting the class make it elsewhere, so the first step's host memory is the buffer's too.

    Example::

        >>> probe_start(torch.optim.AdamW, {"lr": 0.1}, {"fused": True}, torch.float32)
        {'step': tensor(0.)}
    """
    hyper = accepted_settings(cls, group)
    runs: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for _ in ("the class's start", "zeros"):
        param = torch.linspace(-1, 1, 2 * SPLIT + 3, dtype=dtype).requires_grad_(True)  # (SIMD and tail)
        optimizer = cls([param], **{**hyper, **kernel})
        if runs:
            optimizer.state[param] = {k: torch.zeros_like(v) for k, v in runs[0][1].items()}
        for step in range(2):
            param.grad = torch.linspace(0.5, -0.25 * (step + 1), param.numel(), dtype=dtype)
            optimizer.step()
        state = optimizer.state[param]
        if not all(torch.is_tensor(v) for v in state.values()):
            return None  # (a state value that is no tensor: no zero to start it from)
        runs.append((param.detach(), state))
    (ours, mine), (theirs, zeroed) = runs
    if not torch.equal(ours, theirs) or mine.keys() != zeroed.keys():
        return None
    if not all(torch.equal(mine[k], zeroed[k]) for k in mine):
        return None
    return {k: torch.zeros_like(v) for k, v in mine.items() if v.dim() == 0}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to
