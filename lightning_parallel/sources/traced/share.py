"""One export for every rank: the traced program exported on one rank and handed to the others.

Every rank of a pipeline traces the same forward of the same model at the same input shape, and
``torch.export`` is the costly part of a trace (seconds for a Hugging Face decoder, on each rank, at
setup and again for each mode). With a :class:`ProgramShare`, one rank exports and the others receive
the program and cut their stages from it, exactly as if they had exported it themselves:

* **who exports**: the group's first rank, global rank 0 for the trace at setup (the job's every rank
  takes part: one export per job), the replica's first pipeline rank for a later one (a new mode, or
  a shape the program does not serve), since only the ranks that see the same batches trace at the
  same points;
* **how the program travels**: pickled with torch's ``GraphPickler`` (fake tensors and symbolic sizes
  kept, the weights are the twin's meta tensors: no data), ~1.4 MB for an 8-block Llama, in one
  broadcast over a group that carries CPU tensors (:func:`~lightning_parallel.distributed.host_group.
  host_group`: the group itself on gloo, a gloo twin under NCCL). Loading it costs a fifth of the
  export on a receiving rank (0.7 s against 3.5 s of CPU for that Llama), where ``torch.export.load``
  re-parses every symbolic size and costs three quarters of it (``experiments/bench_trace_share.py``);
* **its device**: the program is exported for the exporting rank's device; a rank on another device of
  the same type (``cuda:1`` for ``cuda:0``) rewrites it (:func:`move_to_device`): the program its own
  export would give, as the stages are then rewritten for the device they run on, as before;
* **mismatches**: before anything travels, every rank's :func:`fingerprint` (torch and Python, the
  model's class, code and tensors, the input, the trace's settings) is gathered; a rank that differs
  from the exporting one stops every rank with the difference named, never a silent difference;
* **failures**: the export (every attempt: dynamic batch, ``Dim.AUTO``, static) runs inside
  :func:`~lightning_parallel.distributed.agree.decide_on`, and its error, explained on the exporting
  rank, is raised on every rank;
* **what it saves**: a node's CPU for the export falls from one export per rank to one export and a
  load per other rank (x0.65 at 2 ranks, x0.4 at 4). The first step does not come sooner on free
  cores (x1.16 for that Llama at 2 ranks: the others wait for the export, then load it), and no later
  where the ranks share the cores (x0.93 at 4 ranks on 2 cores).

Without a process group, or in a world of one, nothing is shared: the rank exports for itself.
``LIGHTNING_PARALLEL_SHARE_TRACES=0`` makes every rank export for itself (the fingerprints are still
compared); it must be the same on every rank, which the fingerprint checks.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten, tree_map

from lightning_parallel.distributed.agree import decide_on, distributed_ready, failing_together, world_size
from lightning_parallel.distributed.collectives import all_gather_objects
from lightning_parallel.distributed.host_group import host_group
from lightning_parallel.sources.fake_device import trace_device

__all__ = [
    "SHARE_ENV",
    "ProgramShare",
    "ShareTally",
    "fingerprint",
    "move_to_device",
    "pack",
    "refuse_mismatch",
    "tally",
    "unpack",
]

SHARE_ENV = "LIGHTNING_PARALLEL_SHARE_TRACES"
"""``0``: every rank exports for itself (to measure against, or to rule sharing out)."""


class Exported(NamedTuple):
    """What one export gives every rank: the program, and what the exporting rank learned running forward."""

    program: torch.export.ExportedProgram
    failure: str | None  # why the program is static (no dynamic export succeeded), or None
    out_spec: Any = None  # the structure of the call's output (a ModelOutput...), None for a tensor


@dataclass
class ShareTally:
    """What this process exported and received, and the CPU seconds it spent (tests, benchmarks)."""

    exported: int = 0  # programs this process exported (for itself or for every rank)
    received: int = 0  # programs it loaded from another rank
    export_cpu_s: float = 0.0
    pack_cpu_s: float = 0.0  # pickling the programs it sent
    receive_cpu_s: float = 0.0  # loading, and moving to this rank's device
    sent_bytes: int = 0  # the size of the programs this process sent
    unshared: int = 0  # exports that could not be pickled: every rank exported for itself


tally = ShareTally()


def sharing_on() -> bool:
    """Whether this process shares exports (``LIGHTNING_PARALLEL_SHARE_TRACES`` is not ``0``)."""
    return os.environ.get(SHARE_ENV, "1").strip() != "0"


class ProgramShare:
    """The ranks of ``group`` take one export from its first rank (see the module doc).

    Call :meth:`exported` on every rank of the group at the same point, as any collective.

    Example::

        share = ProgramShare.over(pp_group)      # None in a world of one: nothing to share
        trace(twin, example, points, train=True, share=share)
    """

    def __init__(self, group: Any | None = None) -> None:
        self.group = host_group(group)
        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        self.src, self.ranks = ranks[0], list(ranks)

    @classmethod
    def over(cls, group: Any | None = None) -> ProgramShare | None:
        """A share over ``group``, or ``None`` where it holds one rank (or no process group exists)."""
        if not distributed_ready() or world_size(group) == 1:
            return None
        return cls(group)

    @property
    def is_src(self) -> bool:
        return dist.get_rank() == self.src

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank in the group."""
        return all_gather_objects(obj, self.group)

    def decide(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the exporting rank, its result or its error on every rank."""
        return decide_on(self.src, fn, self.group)

    def together(self) -> Any:
        """A block that fails on every rank of the group if it fails on one."""
        return failing_together(self.group)

    def exported(
        self,
        export: Callable[[], Exported],
        twin: nn.Module,
        example: tuple[Any, ...],
        settings: Mapping[str, Any],
        device: torch.device | str | None,
    ) -> Exported:
        """``export()``'s program on every rank, run on the exporting rank only (see the module doc).

        ``settings`` are what the trace specialises on besides the twin and the example (the mode, the
        split points, the way of calling): they are part of the fingerprint.

        Raises:
            ValueError: a rank's fingerprint differs from the exporting rank's (on every rank).
            Exception: ``export()``'s error on the exporting rank (on every rank).
        """
        on, device = sharing_on(), trace_device(device)
        settings = {**settings, "device type": device.type, "sharing": "on" if on else "off"}
        prints = self.gather(fingerprint(twin, example, settings))
        refuse_mismatch(prints, self, tensors=lambda: self.gather(_tensor_list(twin)))
        if not on:
            return _timed_export(export)
        mine: list[Exported] = []

        def export_and_pack() -> bytes | str:
            mine.append(_timed_export(export))
            start = time.process_time()
            try:
                data = pack(mine[0], device)
            except Exception as err:  # (a model's object in the graph that does not pickle)
                tally.unshared += 1
                return f"{type(err).__name__}: {err}"
            finally:
                tally.pack_cpu_s += time.process_time() - start
            tally.sent_bytes += len(data)
            return data

        data = self.decide(export_and_pack)
        with self.together():  # (on every rank: one that cannot load the program stops every rank)
            if self.is_src:
                return mine[0]
            if isinstance(data, str):
                tally.unshared += 1
                warnings.warn(f"the traced program did not pickle ({data}): each rank exports", stacklevel=2)
                return _timed_export(export)
            start = time.process_time()
            received = unpack(data, twin, device)
            tally.received += 1
            tally.receive_cpu_s += time.process_time() - start
        return received


def exported_locally(export: Callable[[], Exported]) -> Exported:
    """``export()`` on this rank alone (no share), counted in :data:`tally`."""
    return _timed_export(export)


def _timed_export(export: Callable[[], Exported]) -> Exported:
    start = time.process_time()
    try:
        return export()
    finally:
        tally.exported += 1
        tally.export_cpu_s += time.process_time() - start


# ----------------------------------------------------------------------------- the fingerprint


def fingerprint(twin: nn.Module, example: tuple[Any, ...], settings: Mapping[str, Any]) -> dict[str, str]:
    """What must be equal on every rank for one rank's export to be every rank's, as short strings.

    The software (torch, Python), the model (its class, the source of its modules' classes, its
    tensors' names, shapes and dtypes), the input (structure, shapes, dtypes) and ``settings``.

    Example::

        fingerprint(twin, example, {"mode": "train"})["torch"]     # "2.13.0+cpu"
    """
    tensors = _tensor_list(twin)
    leaves, spec = tree_flatten(example)
    inputs = [f"{tuple(t.shape)}:{t.dtype}" if torch.is_tensor(t) else repr(t) for t in leaves]
    classes = sorted({type(m) for m in twin.modules()}, key=lambda c: (c.__module__, c.__qualname__))
    return {
        "torch": torch.__version__,
        "Python": ".".join(map(str, sys.version_info[:3])),
        "model": f"{type(twin).__module__}.{type(twin).__qualname__}",
        "model code": _digest(_source_digest(c) for c in classes),
        "parameters and buffers": f"{len(tensors)} tensors, digest {_digest(tensors)}",
        "input": f"{spec} of {', '.join(inputs)}",
        **{k: str(v) for k, v in settings.items()},
    }


def refuse_mismatch(
    prints: list[dict[str, str]],
    share: ProgramShare,
    tensors: Callable[[], list[list[str]]] | None = None,
) -> None:
    """Raise on every rank (the same error) where a rank's fingerprint differs from the exporting rank's.

    ``tensors`` gathers every rank's list of tensors (a collective, reached by every rank when their
    digests differ), to name the first tensor that differs.
    """
    src = prints[share.ranks.index(share.src)]
    for rank, mine in zip(share.ranks, prints):
        differs = [k for k in src if mine.get(k) != src[k]]
        if not differs:
            continue
        found = "; ".join(
            f"{k}: {src[k]!r} on rank {share.src}, {mine.get(k)!r} on rank {rank}" for k in differs
        )
        if "parameters and buffers" in differs and tensors is not None:
            lists = tensors()
            theirs, ours = lists[share.ranks.index(rank)], lists[share.ranks.index(share.src)]
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
            )
            at = lambda names, i: repr(names[i]) if i < len(names) else "none"  # noqa: E731
            found += (
                f"; the first tensor that differs: {at(ours, first)} on rank {share.src}, {at(theirs, first)}"
            )
            found += f" on rank {rank}"
        raise ValueError(
            f"PipelineStrategy exports the traced forward on global rank {share.src} and hands the "
            f"program to the other ranks, but global rank {rank} differs from it ({found}). Run every "
            f"rank with the same torch, the same model code and configuration, the same input shapes "
            f"and the same {SHARE_ENV}"
        )


def _tensor_list(twin: nn.Module) -> list[str]:
    """Every parameter and buffer of ``twin`` (ties named twice): name, shape, dtype, requires_grad."""
    named = [*twin.named_parameters(remove_duplicate=False), *twin.named_buffers(remove_duplicate=False)]
    return [f"{n} {tuple(t.shape)} {t.dtype}{'' if t.requires_grad else ' frozen'}" for n, t in named]


def _digest(parts: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def _source_digest(cls: type) -> str:
    """The digest of the file defining ``cls`` (its name where it has none: a class made in a notebook)."""
    try:
        path = inspect.getsourcefile(cls)
        if path is not None:
            with open(path, "rb") as f:
                return hashlib.blake2b(f.read(), digest_size=8).hexdigest()
    except (OSError, TypeError):
        pass
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------ the transport


def pack(exported: Exported, device: torch.device) -> bytes:
    """An export (the program, why it is static, the output's structure) and its device, as bytes.

    torch's ``GraphPickler`` (private, checked against torch 2.13; test_trace_share.py fails loudly if
    it moves) keeps the fake tensors and symbolic sizes of the graph; every op and every node's
    metadata travel (its default keeps torch's own ops only, and drops the module stacks that cutting
    the stages reads).
    """
    from torch.fx._graph_pickler import GraphPickler, Options

    every = Options(ops_filter=None, node_metadata_key_filter=None)
    return GraphPickler.dumps((tuple(exported), str(device)), every)


def unpack(data: bytes, twin: nn.Module, device: torch.device) -> Exported:
    """The export of :func:`pack`, for ``device`` and holding ``twin``'s meta tensors.

    A program exported for another device of the same type (``cuda:0``) is moved to ``device``
    (``cuda:1``); its parameters and buffers are pointed at the twin's, as on the exporting rank.
    """
    from torch.fx._graph_pickler import GraphPickler

    fields, exported_for = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    exported = Exported(*fields)
    _hold_twins(exported.program, twin)
    if exported_for != str(device):
        move_to_device(exported.program, torch.device(exported_for), device)
    return exported


def move_to_device(program: torch.export.ExportedProgram, old: torch.device, new: torch.device) -> None:
    """Rewrite ``program``'s device ``old`` as ``new``: the devices its ops are given, and its fake values.

    What ``torch.export.passes.move_to_device_pass`` does to the graph, without its ``.to()`` of the
    parameters and buffers: those are the twin's meta tensors, which a copy to ``cuda:1`` would
    allocate in full. The program's other fake tensors (constants, example inputs) move too.
    """

    def moved(value: Any) -> Any:
        if isinstance(value, torch.device) and value == old:
            return new
        if isinstance(value, FakeTensor) and value.device == old:
            with value.fake_mode:  # (outside its mode, a fake CUDA tensor's copy initialises CUDA)
                return value.to(new)
        return value

    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args, node.kwargs = tree_map(moved, (node.args, node.kwargs))
            if "val" in node.meta:
                node.meta["val"] = tree_map(moved, node.meta["val"])
        module.recompile()
    for name, value in list(program.constants.items()):
        program.constants[name] = moved(value)
    if program.example_inputs is not None:
        program._example_inputs = tree_map(moved, program.example_inputs)


def _hold_twins(program: torch.export.ExportedProgram, twin: nn.Module) -> None:
    """Point the program's parameters and buffers (and buffers lifted as constants) at ``twin``'s."""
    own = {
        **dict(twin.named_parameters(remove_duplicate=False)),
        **dict(twin.named_buffers(remove_duplicate=False)),
    }
    for table in (program.state_dict, program.constants):
        for name in [n for n in table if n in own]:
            table[name] = own[name]
