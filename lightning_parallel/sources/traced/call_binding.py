"""One call of the pipelined module as the pipeline runs it: tensors in, tensors out, the rest held constant.

Users call a Hugging Face decoder as ``self.model(input_ids=x, attention_mask=m, use_cache=False)`` and
read ``.logits`` or ``.loss`` from the ``ModelOutput`` it returns. torch's pipeline stages take and
return tensors only. A :class:`CallBinding` maps one to the other: the call's tensors (positional or
keyword) become the pipeline's positional inputs, in order; everything else (``use_cache=False``,
``return_dict=True``) is baked into the traced graph as a constant; the output is flattened to its
tensors for the stages and rebuilt (the same ``ModelOutput``) for the user's step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_parallel.pipeline.proxy import CapturedInput, PipelinedCall


@dataclass
class CallBinding:
    """How one call's arguments and output map to the pipeline's tensors.

    Args:
        path: the called module's path in the LightningModule (``""``: its own ``forward``).
        in_spec: the structure of ``(args, kwargs)``.
        constants: every leaf that is not a tensor, in order (``None`` where a tensor goes).

    Example::

        binding, tensors = CallBinding.of("model", (), {"input_ids": x, "use_cache": False})
        tensors                       # (x,): what the schedule feeds the first stage
        binding.arguments(tensors)    # ((), {"input_ids": x, "use_cache": False})
    """

    path: str
    in_spec: pytree.TreeSpec
    constants: tuple[Any, ...]
    out_spec: pytree.TreeSpec | None = field(default=None, compare=False)  # known once traced

    @classmethod
    def of(cls, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[CallBinding, tuple]:
        """The binding of a call and its tensors, in the order the pipeline takes them."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        tensors = tuple(x for x in leaves if torch.is_tensor(x))
        constants = tuple(None if torch.is_tensor(x) else x for x in leaves)
        return cls(path, spec, constants), tensors

    @property
    def key(self) -> str:
        """What a trace specialises on besides the tensors' shapes (the structure and the constants)."""
        return f"{self.path}|{self.in_spec}|{self.constants!r}"

    def same_call(self, other: CallBinding) -> bool:
        return self.key == other.key

    def arguments(self, tensors: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the call, with ``tensors`` in the tensors' places."""
        supply = iter(tensors)
        leaves = [next(supply) if c is None else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.in_spec)

    def flat_output(self, output: Any) -> Any:
        """The call's output as the stages return it: a tensor as is, anything else its tensors."""
        if torch.is_tensor(output):
            self.out_spec = None
            return output
        leaves, self.out_spec = pytree.tree_flatten(output)
        strays = [type(x).__name__ for x in leaves if not torch.is_tensor(x)]
        if strays:
            raise TypeError(
                f"the pipelined call `{self.path or 'forward'}` returns non-tensor values "
                f"({', '.join(strays)}) beside its tensors: under PipelineStrategy it may return tensors, "
                f"tuples, dicts or a ModelOutput of tensors only (use_cache=False for Hugging Face models)"
            )
        return tuple(leaves)

    def output(self, flat: Any) -> Any:
        """The user's view of a stage output: the structure the call returns (a ``ModelOutput``...)."""
        if self.out_spec is None:
            return flat
        leaves = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        return pytree.tree_unflatten(leaves, self.out_spec)


@contextmanager
def bound_forward(root: nn.Module, binding: CallBinding) -> Iterator[None]:
    """Make ``root(*tensors)`` run the bound call (on a meta twin, for tracing); undone on exit.

    The call goes to ``root.get_submodule(binding.path)``, so the traced graph's module paths stay
    those of the LightningModule. Hugging Face configs are switched to ``use_cache=False`` meanwhile:
    a key/value cache built in the first stage and returned by the last has no place in a pipeline
    (torchtitan's Hugging Face backend does the same).
    """
    cls_forward = type(root).forward

    def forward(*tensors: Any) -> Any:
        args, kwargs = binding.arguments(tensors)
        target = root.get_submodule(binding.path)
        out = cls_forward(root, *args, **kwargs) if target is root else target(*args, **kwargs)
        return binding.flat_output(out)

    configs = {
        id(c): c
        for m in root.modules()
        if (c := getattr(m, "config", None)) is not None and getattr(c, "use_cache", None) is True
    }
    saved = root.__dict__.get("forward")
    root.forward = forward
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True
        if saved is None:
            del root.forward
        else:
            root.forward = saved


class TracedCall(PipelinedCall):
    """The traced path's stand-in: installed at the module the user's step calls, keywords allowed.

    The first stage feeds the schedule the call's tensors (:class:`CallBinding`); the last stage's
    step gets the call's output back in the structure the module returns. One binding per mode
    (training, evaluation): a step that calls the module with other constants or keywords than the
    first step of its mode is refused, since the traced graph holds the first ones.

    Example::

        call = TracedCall("`self.model(...)`")
        call.install(module, "model")            # self.model(input_ids=x) now goes through it
        tensors = call.capture(module.training_step, batch, 0)
    """

    accepts_keywords = True

    def __init__(self, what: str, held: str = "") -> None:
        super().__init__(what, held)
        self.bindings: dict[bool, CallBinding] = {}
        self.path: str | None = None

    def install(self, module: nn.Module, path: str) -> None:
        """Put the stand-in in place of ``module.get_submodule(path).forward``."""
        target = module.get_submodule(path)
        target.forward = functools.partial(self.call_from, path)

    @staticmethod
    def uninstall(module: nn.Module, path: str) -> None:
        target = module.get_submodule(path)
        target.__dict__.pop("forward", None)

    def captured_input(self, captured: CapturedInput) -> tuple[Any, ...]:
        binding, tensors = CallBinding.of(captured.path, captured.args, captured.kwargs)
        known = self.bindings.get(self.train)
        if known is None:
            self.bindings[self.train], self.path = binding, captured.path
        elif not known.same_call(binding):
            raise ValueError(
                f"{self.what} was called with other arguments than at the first "
                f"{'training' if self.train else 'evaluation'} step ({_describe(binding)} instead of "
                f"{_describe(known)}): under PipelineStrategy each mode calls the pipelined module the "
                f"same way at every step (the same keywords and non-tensor values)"
            )
        return tensors

    def _replayed_output(self, output: Any) -> Any:
        return self.bindings[self.train].output(output)

    def target(self, module: nn.Module) -> nn.Module | None:
        if self.path is None or True not in self.bindings:
            return None
        return module.get_submodule(self.path) if self.path else module

    def keywords(self, tensors: tuple[Any, ...] | None = None) -> dict[str, Any]:
        binding = self.bindings.get(self.train) or self.bindings[True]
        if tensors is None:  # placeholders: which keywords the call passes, not their values
            tensors = tuple(torch.zeros(1) for c in binding.constants if c is None)
        return binding.arguments(tensors)[1]


def _describe(binding: CallBinding) -> str:
    args, kwargs = binding.arguments(tuple("<tensor>" for c in binding.constants if c is None))
    named = (f"{k}={v if v == '<tensor>' else repr(v)}" for k, v in kwargs.items())
    shown = [*("<tensor>" for _ in args), *named]
    return f"`{binding.path or 'self'}({', '.join(shown)})`"
