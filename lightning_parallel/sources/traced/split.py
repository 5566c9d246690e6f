"""Where a traced forward is split: stage beginnings on the model's blocks (or the user's split points),
and this rank's part of the module kept.

By default a stage begins at a block of the module's main ``nn.ModuleList`` (the one holding most
parameters): the modules ``forward`` calls before the first block (embeddings) go with the first stage,
those after the last block (final norm, head) with the last one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_parallel.pipeline.blocks import find_block_list


def check_split_points(
    module: nn.Module, points: Sequence[str], order: Sequence[str], num_stages: int
) -> list[str]:
    """Validate user-given split points against the module and the order forward calls modules in."""
    points = list(points)
    position = {path: i for i, path in enumerate(order)}
    for p in points:
        if not isinstance(p, str):
            raise TypeError(f"split_points must be module paths (str), got {p!r}")
        try:
            module.get_submodule(p)
        except AttributeError:
            raise ValueError(
                f"split_points: {type(module).__name__} has no submodule {p!r}; the blocks are "
                f"{_blocks_hint(module)}"
            ) from None
        if p not in position:
            raise ValueError(f"split_points: {p!r} is never called by {type(module).__name__}.forward")
    if len(points) + 1 != num_stages:
        raise ValueError(
            f"split_points names {len(points)} stage beginnings ({points}), which make {len(points) + 1} "
            f"stages, but the pipeline has {num_stages} (pipeline_size x stages_per_rank): give "
            f"{num_stages - 1} split points"
        )
    if [position[p] for p in points] != sorted(position[p] for p in points) or len(set(points)) < len(points):
        raise ValueError(f"split_points must be distinct and in the order forward calls them, got {points}")
    return points


def _blocks_hint(module: nn.Module) -> str:
    try:
        path, names = find_block_list(module)
    except ValueError:
        return "(no nn.ModuleList found)"
    return f"{path}.{names[0]} .. {path}.{names[-1]}"


def block_entry(order: Sequence[str], block: str) -> str:
    """Where a stage beginning at ``block`` is split: the block, or where a block that is only a container
    (x-transformers' ``layers.2``, a ``ModuleList`` of norm, layer and residual) is first entered.

    Raises:
        ValueError: forward never calls the block or anything inside it.
    """
    if block in order:
        return block
    inside = [p for p in order if p.startswith(f"{block}.")]
    if not inside:
        raise ValueError(
            f"`{block}` is never called by forward, nor anything inside it: name the stage beginnings with "
            f"split_points=[...] (module paths forward calls)"
        )
    return inside[0]


def block_extras(module: nn.Module, order: Sequence[str], block_path: str) -> tuple[int, int]:
    """Parameters of the modules called before the first block and after the last (each counted once)."""
    blocks = [p for p in order if p.startswith(f"{block_path}.")]
    first, last = order.index(blocks[0]), order.index(blocks[-1])
    seen: set[int] = {id(p) for p in module.get_submodule(block_path).parameters()}

    def params_of(paths: Sequence[str]) -> int:
        total = 0
        for path in paths:
            if path.startswith(f"{block_path}.") or path == block_path:
                continue
            for p in module.get_submodule(path).parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    return params_of(order[:first]), params_of(order[last + 1 :])


def keep_only(module: nn.Module, keep: set[str]) -> None:
    """Drop from ``module`` every parameter and buffer outside ``keep``, and the submodules left empty.

    Submodules without parameters or buffers stay (they cost nothing); state-dict keys of what stays
    are unchanged, so checkpoints keep the unsplit module's names.
    """
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        tensors = [n for n, _ in [*child.named_parameters(remove_duplicate=False), *child.named_buffers()]]
        if tensors and not any(f"{name}.{t}" in keep for t in tensors):
            del module._modules[name]
        elif tensors:
            keep_only(child, {k[len(name) + 1 :] for k in keep if k.startswith(f"{name}.")})
    # A module's buffers stay together when one is kept: a Hugging Face rotary embedding reads only
    # `inv_freq` in forward, but re-initialising it from the meta device needs `original_inv_freq`.
    keeps_own = any(k in keep for k in [*module._parameters, *module._buffers])
    for slot in (module._parameters, module._buffers):
        if slot is module._buffers and keeps_own:
            continue
        for leaf in [k for k, v in slot.items() if v is not None and k not in keep]:
            del slot[leaf]  # (an unset slot such as ``bias=None`` stays: reset_parameters reads it)
