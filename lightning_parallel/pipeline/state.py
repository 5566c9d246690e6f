"""Local stage state <-> the unsplit module's state: merge the stages' parts, reshard on load.

Model state needs no renaming: the proxy keeps the original child names, so a stage's
``state_dict`` keys are already the unsplit keys. Optimizer state is keyed by parameter name in
transit and turned into torch's usual layout (integer ids in model order, plus ``param_names``) on
the receiving rank, so a plain single-device optimizer loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


def to_cpu(tree: Any) -> Any:
    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def check_keys(expected: Iterable[str], found: Mapping[str, Any], owner: str) -> None:
    """Raise a KeyError naming the missing and unexpected keys of a state dict, if any."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise KeyError(
            f"the checkpoint does not match {owner}: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )


def _outer_inner(optimizer: Any) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(the optimizer whose param_groups carry the hyper-parameters, the one holding this rank's state)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    outer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    inner = outer.optim if isinstance(outer, ZeroRedundancyOptimizer) else outer
    return outer, inner


def optimizer_type(optimizer: Any) -> str:
    """The class name of the optimizer that steps (inside a LightningOptimizer or ZeRO-1): what a
    checkpoint names, so that ZeRO-1's AdamW and a plain AdamW resume each other's state."""
    return type(_outer_inner(optimizer)[1]).__name__


def named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: Mapping[nn.Parameter, str],
    gather: Callable[[Any], Any] | None = None,
) -> dict:
    """The optimizer's state keyed by parameter name instead of position (portable across splits).

    ``gather`` turns the state's tensors into full ones first (``full_tensors`` for sharded ones).
    """
    sd = optimizer.state_dict()
    if gather is not None:
        sd = {**sd, "state": gather(sd["state"])}
    id_to_name = {}
    for group, sd_group in zip(optimizer.param_groups, sd["param_groups"]):
        for p, pid in zip(group["params"], sd_group["params"]):
            id_to_name[pid] = names[p]
    groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "param_names")},
         "params": [id_to_name[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]  # fmt: skip
    return {
        "type": optimizer_type(optimizer),
        "state": {id_to_name[i]: to_cpu(s) for i, s in sd["state"].items()},
        "param_groups": groups,
    }


def merge_optimizer_states(parts: Iterable[dict], order: Sequence[str] | None = None) -> dict:
    """Join the stages' named states into torch's single-device layout.

    A tied weight held by several stages appears once (its replicas' states are identical). With
    ``order`` (the unsplit module's parameter names in ``parameters()`` order), parameters are numbered
    in that order, so a plain single-device optimizer loads the state by position.
    """
    parts = list(parts)
    num_groups = {len(p["param_groups"]) for p in parts}
    if len(num_groups) != 1:
        raise RuntimeError(f"stages disagree on the number of optimizer param groups: {sorted(num_groups)}")
    types = {p["type"] for p in parts}
    if len(types) != 1:
        raise RuntimeError(f"stages use different optimizer types: {sorted(types)}")
    rank = {name: i for i, name in enumerate(order or [])}
    groups: list[dict] = []
    state: dict[int, Any] = {}
    seen: set[str] = set()
    next_id = 0
    for g in range(num_groups.pop()):
        merged = {k: v for k, v in parts[0]["param_groups"][g].items() if k != "params"}
        names = [
            n for part in parts for n in part["param_groups"][g]["params"] if not (n in seen or seen.add(n))
        ]
        names.sort(key=lambda n: rank.get(n, len(rank)))
        states = {n: part["state"][n] for part in reversed(parts) for n in part["state"]}
        merged["params"] = list(range(next_id, next_id + len(names)))
        merged["param_names"] = names
        for i, name in zip(merged["params"], names):
            if name in states:
                state[i] = states[name]
        next_id += len(names)
        groups.append(merged)
    return {"state": state, "param_groups": groups, "optimizer_type": types.pop()}


# Not what tells optimizers apart: the parameters, and the keys a learning-rate scheduler adds to a group
# (the LR finder saves its checkpoint before its scheduler adds "initial_lr", and restores it after).
_NOT_HYPER = frozenset(
    {"params", "param_names", "initial_lr", "base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"}
)


def reshard_optimizer_state(
    full: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    names: Mapping[nn.Parameter, str],
    model_param_order: list[str],
) -> dict:
    """This rank's slice of a consolidated (or single-device) optimizer state, in its own layout.

    ``model_param_order`` names the unsplit model's parameters in ``parameters()`` order; it maps a
    checkpoint without ``param_names`` (written by one device or DDP, one param group) onto names.
    """
    saved_groups = full["param_groups"]
    saved_type = full.get("optimizer_type")
    if saved_type is not None and saved_type != optimizer_type(optimizer):
        raise ValueError(
            f"the checkpoint's optimizer is {saved_type} but configure_optimizers made "
            f"{optimizer_type(optimizer)}: resume with the same optimizer"
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups but configure_optimizers "
            f"made {len(optimizer.param_groups)}: resume with the same optimizer and param grouping"
        )
    id_to_name = _checkpoint_param_names(saved_groups, model_param_order)
    name_to_id = {n: i for i, n in id_to_name.items()}
    state, groups, local_id = {}, [], 0
    for group, saved in zip(optimizer.param_groups, saved_groups):
        hyper_now = set(group) - _NOT_HYPER
        hyper_saved = set(saved) - _NOT_HYPER
        if hyper_now != hyper_saved:
            raise ValueError(
                f"the checkpoint's optimizer has hyper-parameters {sorted(hyper_saved)} but this one has "
                f"{sorted(hyper_now)}: resume with the same optimizer"
            )
        ids = []
        for p in group["params"]:
            name = names[p]
            if name not in name_to_id:
                raise ValueError(
                    f"parameter {name} is not in the checkpoint's optimizer state: resume with the same "
                    f"optimizer and param grouping as the run that saved it"
                )
            gid = name_to_id[name]
            if gid not in saved["params"]:
                raise ValueError(f"parameter {name} is in another optimizer param group in the checkpoint")
            if gid in full["state"]:
                state[local_id] = _checked_shapes(full["state"][gid], p, name)
            ids.append(local_id)
            local_id += 1
        groups.append(
            {**{k: v for k, v in saved.items() if k not in ("params", "param_names")}, "params": ids}
        )
    return {"state": state, "param_groups": groups}


def _checked_shapes(param_state: Mapping[str, Any], param: torch.Tensor, name: str) -> Mapping[str, Any]:
    """A parameter's saved state, refused when its per-element tensors (Adam's moments) do not fit it.

    A checkpoint without ``param_names`` is matched to the model's parameters by position; an optimizer
    built over another order or subset would otherwise hand one parameter another's state.
    """
    for key, value in param_state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
            raise ValueError(
                f"the checkpoint's optimizer state {key!r} for {name} has shape {tuple(value.shape)} but the "
                f"parameter has {tuple(param.shape)}: the saved optimizer listed its parameters in another "
                f"order; resume with the same optimizer, or build it with named parameters "
                f"(torch.optim.AdamW(self.named_parameters())) so the checkpoint carries the names"
            )
    return param_state


def _checkpoint_param_names(saved_groups: list[dict], model_param_order: list[str]) -> dict[int, str]:
    if all("param_names" in g for g in saved_groups):
        return {i: n for g in saved_groups for i, n in zip(g["params"], g["param_names"])}
    if len(saved_groups) != 1:
        raise ValueError(
            "this checkpoint's optimizer state has several param groups without parameter names; "
            "PipelineStrategy can map it onto stages only with one group or with `param_names`"
        )
    ids = saved_groups[0]["params"]
    if len(ids) != len(model_param_order):
        raise ValueError(
            f"the checkpoint's optimizer holds {len(ids)} parameters but the model has "
            f"{len(model_param_order)}: resume with the same model and optimizer"
        )
    return dict(zip(ids, model_param_order))
