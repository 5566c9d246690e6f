"""``torch.export`` with dynamic sizes, as both split paths use it to learn a program's shapes once."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.export import Dim


def export_for_pipeline(
    module: nn.Module, example: tuple[Any, ...], dynamic: bool = True
) -> tuple[torch.export.ExportedProgram, str | None]:
    """``torch.export`` of ``module(*example)``, with dynamic sizes if ``dynamic``.

    Every input dimension is ``Dim.AUTO`` (dynamic where the model lets it, specialised where it
    does not), except the micro-batch dimension (dim 0 of every input, one size): tried first as a
    ``Dim`` from 1, so a micro-batch of one sample (a short last batch) is served too, which
    ``Dim.AUTO`` never allows (it specialises sizes of 0 and 1). Returns the program and, when no
    dynamic export succeeded and a static one was made instead, the first line of export's reason
    (``None`` otherwise).

    Raises:
        RuntimeError: export failed (its error is the ``__cause__``), as ``pipeline()`` raises it.
    """
    failure = None
    for batch in (Dim("microbatch", min=1), Dim.AUTO) if dynamic else ():
        try:
            fresh = _fresh(example)
            return torch.export.export(module, fresh, dynamic_shapes=_dims(module, fresh, batch)), None
        except Exception as err:  # export raises many types; the next attempt says whether it is the shape
            failure = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    try:
        return torch.export.export(module, _fresh(example)), failure
    except Exception as err:
        raise RuntimeError("torch.export could not capture the module's forward as one graph") from err


def _fresh(example: tuple[Any, ...]) -> tuple[Any, ...]:
    """New tensor objects for one export attempt: a failed export leaves its dimension markers on its
    inputs (``_dynamo_dynamic_indices``), which would make the next attempt's sizes what the last asked."""
    return tuple(t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in example)


def _dims(module: nn.Module, example: tuple[Any, ...], batch: Any) -> tuple[Any, ...]:
    specs = tuple(
        {d: batch if d == 0 else Dim.AUTO for d in range(t.dim())} if torch.is_tensor(t) and t.dim() else None
        for t in example
    )
    params = list(inspect.signature(module.forward).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return (specs,)  # forward(*tensors) (a bound call): one spec, a tuple, for the varargs
    return specs
