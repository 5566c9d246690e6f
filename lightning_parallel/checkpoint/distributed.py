"""A rank's model and optimizer state for torch.distributed.checkpoint, keyed by the unsplit module's names.

Model state is the stage module's ``state_dict()`` as it is (a pipeline stage keeps the unsplit names;
FSDP2 stages hold DTensors, whose shards DCP writes from their owners; replicas and tied weights are
plain tensors that DCP writes once). Optimizer state is flattened per parameter name, in the layout of
torch's ``StateDictOptions(flatten_optimizer_state_dict=True)`` (``state.<name>.<key>``,
``param_groups.<name>.<key>``), the layout torchtitan uses for pipelines: no two stages share a key, and
a rank of another split reads the keys of the parameters it holds now. It is written here rather than
by ``get_optimizer_state_dict`` for two reasons: a tied weight must carry one canonical name on every
stage (``get_optimizer_state_dict`` names it by the path this rank reaches it by, so a checkpoint saved
by the stage holding ``lm_head`` could not be read by one holding ``wte``), and a ZeRO-1 optimizer keeps
its shard in an inner optimizer that torch's helper does not know. A parameter's param-group index is
stored too (``param_groups.<name>.__group__``) so one process can rebuild torch's single-device layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_parallel.pipeline.state import _outer_inner, merge_optimizer_states, optimizer_type

__all__ = [
    "GROUP_INDEX",
    "flat_optimizer_state",
    "load_flat_optimizer_state",
    "load_state",
    "optimizer_template",
    "optimizer_type",
    "read_all",
    "saved_keys",
    "single_device_optimizer_state",
]

GROUP_INDEX = "__group__"
_NOT_HYPER = ("params", "param_names")


def flat_optimizer_state(optimizer: Any, names: Mapping[nn.Parameter, str]) -> dict[str, Any]:
    """This rank's optimizer state, flattened by parameter name (a ZeRO-1 rank: its shard's state only).

    Example::

        flat = flat_optimizer_state(optimizer, {p: n for n, p in model.named_parameters()})
        flat["state.layers.0.weight.exp_avg"]      # a tensor (a DTensor for an FSDP2 parameter)
    """
    outer, inner = _outer_inner(optimizer)
    flat: dict[str, Any] = {}
    for index, group in enumerate(outer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        for p in group["params"]:
            name = names[p]
            flat.update({f"param_groups.{name}.{k}": v for k, v in hyper.items()})
            flat[f"param_groups.{name}.{GROUP_INDEX}"] = index
            flat.update({f"state.{name}.{k}": v for k, v in inner.state.get(p, {}).items()})
    return flat


def saved_keys(path: str) -> dict[str, Any]:
    """The checkpoint's keys and their storage metadata (shapes, dtypes), read from ``.metadata``."""
    return dict(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def optimizer_template(
    optimizer: Any, names: Mapping[nn.Parameter, str], saved: Mapping[str, Any], prefix: str
) -> dict[str, Any]:
    """Placeholders for the keys this rank's optimizer reads from a checkpoint (``prefix``: ``optimizer_0``).

    Raises:
        ValueError: a parameter of this optimizer is not in the checkpoint's optimizer state.
    """
    outer, inner = _outer_inner(optimizer)
    owned = {p for g in inner.param_groups for p in g["params"]}
    by_param: dict[str, list[tuple[str, Any]]] = {}
    for key, meta in saved.items():
        if key.startswith(f"{prefix}.state."):
            name, _, state_key = key[len(prefix) + 7 :].rpartition(".")
            by_param.setdefault(name, []).append((state_key, meta))
    template: dict[str, Any] = {}
    for group in outer.param_groups:
        for p in group["params"]:
            name = names[p]
            if f"{prefix}.param_groups.{name}.{GROUP_INDEX}" not in saved:
                raise ValueError(
                    f"parameter {name} is not in the checkpoint's {prefix} state: resume with the same model "
                    "and optimizers as the run that saved it"
                )
            hyper = [k for k in group if k not in _NOT_HYPER]
            template.update({f"param_groups.{name}.{k}": None for k in [*hyper, GROUP_INDEX]})
            if p in owned:
                template.update({f"state.{name}.{k}": _placeholder(m, p) for k, m in by_param.get(name, [])})
    return template


def _placeholder(meta: Any, param: torch.Tensor) -> Any:
    if isinstance(meta, BytesStorageMetadata):
        return None
    assert isinstance(meta, TensorStorageMetadata)
    dtype = meta.properties.dtype
    if isinstance(param, DTensor) and tuple(meta.size) == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype)  # placed as the (sharded) parameter: DCP reads its slice
    return torch.empty(tuple(meta.size), dtype=dtype)


def load_flat_optimizer_state(
    optimizer: Any, names: Mapping[nn.Parameter, str], flat: Mapping[str, Any]
) -> None:
    """Put a loaded flat state (:func:`optimizer_template` filled by DCP) into ``optimizer``.

    Raises:
        ValueError: the checkpoint puts a parameter in another param group.
    """
    outer, inner = _outer_inner(optimizer)
    for index, group in enumerate(outer.param_groups):
        for p in group["params"]:
            saved_index = flat[f"param_groups.{names[p]}.{GROUP_INDEX}"]
            if saved_index != index:
                raise ValueError(
                    f"parameter {names[p]} is in param group {saved_index} in the checkpoint but in {index} "
                    "now: resume with the same optimizer and param grouping"
                )
        if group["params"]:
            first = names[group["params"][0]]
            group.update({k: flat[f"param_groups.{first}.{k}"] for k in group if k not in _NOT_HYPER})
    sd = inner.state_dict()
    state = {}
    for outer_group, group, sd_group in zip(outer.param_groups, inner.param_groups, sd["param_groups"]):
        sd_group.update({k: v for k, v in outer_group.items() if k not in _NOT_HYPER})
        for p, i in zip(group["params"], sd_group["params"]):
            prefix = f"state.{names[p]}."
            found = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
            if found:
                state[i] = found
    inner.load_state_dict({**sd, "state": state})


def load_state(state: dict[str, Any], path: str, strict: bool = True) -> None:
    """Fill ``state``'s tensors in place (and its other values) from the checkpoint at ``path``."""
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    dcp.load(state, checkpoint_id=path, planner=planner)


def read_all(path: str) -> dict[str, Any]:
    """Every key of a checkpoint as plain tensors and values, in this process (flat DCP keys).

    Example::

        everything = read_all("ckpt/last.ckpt")
        everything["state_dict.layers.0.weight"]     # the full tensor
    """
    saved = saved_keys(path)
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        if isinstance(m, TensorStorageMetadata)
        else None
        for k, m in saved.items()
    }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def single_device_optimizer_state(
    flat: Mapping[str, Any], model_param_order: list[str], type_name: str
) -> dict:
    """A flat optimizer state (all parameters) in torch's single-device layout, numbered in model order.

    Example::

        full = single_device_optimizer_state(flat, [n for n, _ in model.named_parameters()], "AdamW")
        torch.optim.AdamW(model.parameters()).load_state_dict(full)
    """
    hyper: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        name, _, item = rest.rpartition(".")
        (hyper if section == "param_groups" else state).setdefault(name, {})[item] = value
    groups: list[dict[str, Any]] = []
    for name in sorted(
        hyper, key=lambda n: model_param_order.index(n) if n in model_param_order else len(hyper)
    ):
        values = dict(hyper[name])
        index = values.pop(GROUP_INDEX)
        while len(groups) <= index:
            groups.append({"params": []})
        groups[index].update(values)
        groups[index]["params"].append(name)
    return merge_optimizer_states(
        [{"type": type_name, "state": state, "param_groups": groups}], model_param_order
    )
