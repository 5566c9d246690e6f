"""Pretrained weights from ``save_pretrained`` files, read per stage: each rank reads only its own tensors.

A model too big for one device is built on the meta device (``configure_model`` or
``Trainer.init_module(empty_init=True)``); :func:`load_pretrained` marks where its weights are, and
when PipelineStrategy materialises a rank's stage it reads exactly the tensors that stage holds from
the safetensors files (memory-mapped, one tensor at a time). On a model that is not on the meta
device (one device, no pipeline) it loads everything at once, so the same LightningModule runs both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

_PENDING = "_lightning_parallel_pretrained"  # attribute that marks a meta module's weights directory


def load_pretrained(module: nn.Module, directory: str | os.PathLike) -> list[str]:
    """Load ``save_pretrained`` safetensors weights into ``module`` (now, or per stage on the meta device).

    Keys are the module's own state-dict keys (a ``transformers`` model's, as ``save_pretrained``
    writes them). A weight tied to another and left out of the files (``lm_head.weight`` of a model
    with ``tie_word_embeddings``) takes the tensor it is tied to, by the model's
    ``_tied_weights_keys``.

    Args:
        module: the model (e.g. ``self.model``, a Hugging Face ``PreTrainedModel``).
        directory: what ``save_pretrained`` wrote (``model.safetensors`` or shards and their index).

    Returns:
        The keys loaded now; ``[]`` when the module is on the meta device (loaded at the split).

    Raises:
        FileNotFoundError: no safetensors weights in ``directory``.
        KeyError: a tensor of the module is in none of the files.

    Example::

        def configure_model(self):               # built on the meta device under PipelineStrategy
            self.model = AutoModelForCausalLM.from_config(config)
            load_pretrained(self.model, "llama-checkpoint/")
    """
    files = _weight_files(Path(directory))
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        setattr(module, _PENDING, str(directory))
        return []
    return _load(module, files)


def load_pending(root: nn.Module) -> list[str]:
    """Load the weights of every submodule of ``root`` marked by :func:`load_pretrained`: its local keys.

    Called once a rank's stage is materialised, so ``root`` holds only that stage's tensors.
    """
    loaded = []
    for path, sub in root.named_modules():
        directory = sub.__dict__.pop(_PENDING, None)
        if directory is not None:
            loaded += [f"{path}.{k}" if path else k for k in _load(sub, _weight_files(Path(directory)))]
    return loaded


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"load_pretrained: no model.safetensors or model.safetensors.index.json in {directory}: "
            f"save the model with save_pretrained(directory) (safetensors, the default)"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _load(module: nn.Module, files: dict[str, Path]) -> list[str]:
    from safetensors import safe_open

    targets = module.state_dict(keep_vars=True)
    ties = _tied_sources(module)
    wanted: dict[Path, list[tuple[str, str]]] = {}
    for key in targets:
        source = key if key in files else ties.get(key)
        if source is None or source not in files:
            raise KeyError(f"load_pretrained: {key} is in none of the weight files ({_some(files)})")
        wanted.setdefault(files[source], []).append((key, source))
    with torch.no_grad():
        for path, keys in wanted.items():
            for key, source in keys:
                # One opening per tensor: the file is memory-mapped, and the pages a read touches stay
                # resident (and counted) until it is closed, so reading a stage under one opening
                # would peak at twice the stage. The header is read again each time (kilobytes).
                with safe_open(str(path), framework="pt") as f:
                    targets[key].copy_(f.get_tensor(source))
    return list(targets)


def _tied_sources(module: nn.Module) -> dict[str, str]:
    """Tied key -> the key the files hold it under, from Hugging Face's ``_tied_weights_keys``."""
    ties: dict[str, str] = {}
    for path, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None)
        if not isinstance(declared, dict):  # used only for keys the files lack (tied, saved once)
            continue
        prefix = f"{path}." if path else ""
        ties.update({prefix + k: prefix + v for k, v in declared.items()})
    return ties


def _some(keys: Iterable[str]) -> str:
    keys = list(keys)
    return ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")
