"""Carrying out a tensor-parallel plan (``plan.py``) on this rank's modules.

``parallelize_module`` splits the planned Linear layers over the tensor-parallel mesh (scattering each
split weight from tensor-parallel rank 0); what stays whole is broadcast from that rank too, so the
ranks of a tensor-parallel group hold the same replicas.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_parallel.distributed.tensors import broadcast_coalesced
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan


def apply_plan(modules: list[nn.Module], names: list[list[str]], plan: TensorPlan, mesh: DeviceMesh) -> None:
    """Split this rank's stage modules over the tensor-parallel ``mesh``, in place.

    ``names[i][j]`` is the LightningModule path of child ``j`` of ``modules[i]`` (``"layers.3"``). The
    parameters that stay whole are broadcast from tensor-parallel rank 0 (the split ones are scattered
    from it by ``parallelize_module``): the ranks of a tensor-parallel group must hold the same replicas.

    Example::

        apply_plan(stages.modules, [["layers.0", "layers.1"]], plan, mesh.device_mesh["tp"])
    """
    for module, child_names in zip(modules, names):
        for (child, child_module), full in zip(module.named_children(), child_names):
            local = {p[len(full) + 1 :]: s for p, s in plan.styles.items() if p.startswith(f"{full}.")}
            if full in plan.styles:
                parallelize_module(module, mesh, {child: plan.styles[full]})
            elif local:
                parallelize_module(child_module, mesh, local)
            for path, counts in plan.head_counts.items():
                if path == full or path.startswith(f"{full}."):
                    target = (
                        child_module.get_submodule(path[len(full) + 1 :]) if path != full else child_module
                    )
                    for attr, value in counts.items():
                        setattr(target, attr, value)
        broadcast_whole(module, mesh)


def apply_held_styles(module: nn.Module, plan: TensorPlan, mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """Split the modules of ``plan`` that this rank holds (a traced stage's pruned module), in place.

    Returns the styles applied, by module path. The whole tensors are broadcast as in :func:`apply_plan`.

    Example::

        held = apply_held_styles(pruned_gpt, plan, mesh.device_mesh["tp"])
    """
    held = {path: style for path, style in plan.styles.items() if _holds_weights(module, path)}
    if held:
        parallelize_module(module, mesh, held)
    broadcast_whole(module, mesh)
    return held


def _holds_weights(module: nn.Module, path: str) -> bool:
    try:
        held = module.get_submodule(path)
    except AttributeError:  # another stage's block, pruned away on this rank
        return False
    return any(t is not None for t in held._parameters.values())


def broadcast_whole(module: nn.Module, mesh: DeviceMesh) -> None:
    """Broadcast ``module``'s parameters and buffers that are not split from tensor-parallel rank 0."""
    whole = [t for t in (*module.parameters(), *module.buffers()) if not isinstance(t, DTensor)]
    with torch.no_grad():
        broadcast_coalesced([t.data for t in whole], mesh.mesh.flatten()[0].item(), mesh.get_group())
