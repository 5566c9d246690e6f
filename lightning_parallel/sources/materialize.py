"""Allocate a module built on the meta device: this rank's tensors only, tied weights re-tied, initialised.

Both stage sources call it once they have dropped the other stages' layers, so a model built with
``empty_init=True`` (or in ``configure_model``) never materialises more than this rank's stages.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.sources.pretrained import load_pending
from lightning_parallel.sources.twin import alias_table, retie


def materialize(module: nn.Module, device: torch.device, aliases: dict[str, str] | None = None) -> None:
    """Allocate meta tensors on ``device``, re-tie shared weights, initialise with ``reset_parameters()``."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    aliases = alias_table(module) if aliases is None else aliases
    module.to_empty(device=device)
    retie(module, aliases)
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    _init_like_hugging_face(module)
    load_pending(module)


def _init_like_hugging_face(module: nn.Module) -> None:
    """Initialise what a Hugging Face model's own ``_init_weights`` covers (norms, rotary tables...).

    ``reset_parameters`` leaves the RMS norms' weights and the buffers computed in ``__init__`` (the
    rotary ``inv_freq``, Gemma's embedding scale) as ``to_empty`` left them: garbage. Duck-typed, so
    this module does not import transformers.
    """
    done: set[int] = set()
    for owner in module.modules():
        init = getattr(owner, "_init_weights", None)
        if id(owner) in done or not callable(init) or getattr(owner, "config", None) is None:
            continue
        with torch.no_grad():
            for sub in owner.modules():
                done.add(id(sub))
                init(sub)
