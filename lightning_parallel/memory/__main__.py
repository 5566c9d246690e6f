"""``python -m lightning_parallel.memory``: will this model fit N devices, and how best?

    python -m lightning_parallel.memory experiments/train_charlm.py:CharLM --init dim=256 depth=8 \\
        --batch long:64 long:64 --global-batch-size 64 --devices 4 --memory 24GiB --optimizer AdamW

The model is ``file.py:Class`` or ``package.module:Class`` (any callable returning an ``nn.Module``),
built with the ``--init`` keyword arguments (on the meta device with ``--meta``, for models too large
for this machine). ``--batch`` gives the tensors of one sample as ``dtype:shape`` (integers are
zeros, floating tensors random), the training step sees them as a tuple; without it the module's
``example_input_array`` is fed to ``forward`` (no loss). Prints one table of candidate configurations
(DDP and pipeline shapes x schedules x micro-batches x recomputation x sharded optimizer state), marks
those whose fullest rank fits ``--memory``, and names the fastest that fits (see
:mod:`lightning_parallel.memory.planner` for the cost model).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_parallel.memory.estimate import format_bytes
from lightning_parallel.memory.facts import measure_model
from lightning_parallel.memory.planner import (
    SEARCHED_SCHEDULES,
    candidate_plans,
    fastest_fit,
    format_plan,
    rank_plans,
    ranked,
)
from lightning_parallel.plan.choices import PRECISIONS

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"24GiB"`` -> 25769803776; ``"1.5GB"``, ``"512MiB"``, ``"1000"`` (bytes) also work.

    Example::

        >>> parse_bytes("2KiB")
        2048
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the memory size {text!r}: write e.g. 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def load_factory(spec: str) -> Any:
    """The callable named by ``file.py:Name`` or ``package.module:Name``.

    Raises:
        ValueError: a malformed spec, a missing file or module, or no such name in it.
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"name the model as file.py:Class or package.module:Class, got {spec!r}")
    if path.endswith(".py"):
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"no such file: {path}")
        sys.path.insert(0, str(file.resolve().parent))  # the script's own imports
        module_spec = importlib.util.spec_from_file_location(f"_memory_model_{file.stem}", file)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            raise ValueError(f"cannot import {path!r}: {err}") from err
    if not hasattr(module, name):
        raise ValueError(f"{path} has no {name!r}")
    return getattr(module, name)


def parse_init(items: list[str]) -> dict[str, Any]:
    """``["dim=256", "name=gpt"]`` -> ``{"dim": 256, "name": "gpt"}`` (Python literals, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--init takes key=value pairs, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def make_batch(specs: list[str], samples: int) -> tuple[torch.Tensor, ...]:
    """Tensors of ``samples`` samples from ``dtype:d1,d2`` specs (one sample's shape).

    Example::

        >>> [tuple(t.shape) for t in make_batch(["long:64", "float32:3,32,32"], 4)]
        [(4, 64), (4, 3, 32, 32)]
    """
    out = []
    for spec in specs:
        dtype_name, _, shape_text = spec.partition(":")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"unknown dtype {dtype_name!r} in --batch {spec!r}: use e.g. long:64 or float32:3,32,32"
            )
        try:
            shape = [int(d) for d in shape_text.split(",") if d.strip()] if shape_text else []
        except ValueError:
            raise ValueError(f"cannot read the shape in --batch {spec!r}: write dtype:d1,d2,...") from None
        if dtype.is_floating_point:
            out.append(torch.randn(samples, *shape, generator=torch.Generator().manual_seed(0)).to(dtype))
        else:
            out.append(torch.zeros(samples, *shape, dtype=dtype))
    return tuple(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lightning_parallel.memory", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("model", help="file.py:Class or package.module:Class")
    p.add_argument(
        "--init", nargs="*", default=[], metavar="KEY=VALUE", help="keyword arguments for the model"
    )
    p.add_argument(
        "--batch", nargs="*", metavar="DTYPE:SHAPE", help="one sample's tensors, e.g. long:64 long:64"
    )
    p.add_argument(
        "--global-batch-size", type=int, default=32, help="samples per optimizer step (default 32)"
    )
    p.add_argument("--devices", type=int, required=True, help="devices in all")
    p.add_argument("--memory", required=True, help="memory per device, e.g. 24GiB, 80GB")
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS), help="(default 32-true)")
    p.add_argument("--optimizer", help="a torch.optim class, when configure_optimizers needs a Trainer")
    p.add_argument("--pipeline-sizes", type=int, nargs="*", help="pipeline sizes to try (default: divisors)")
    p.add_argument("--schedules", nargs="*", default=list(SEARCHED_SCHEDULES), choices=SEARCHED_SCHEDULES)
    p.add_argument(
        "--tensor-parallel-sizes", type=int, nargs="+", default=[1],
        help="tensor-parallel sizes to try (default 1: none), e.g. 1 2 4",
    )  # fmt: skip
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (large models)")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, Any, Any]:
    """The model, the probe batch and the optimizer override from the arguments."""
    factory = load_factory(args.model)
    kwargs = parse_init(args.init)
    with torch.device("meta") if args.meta else torch.device("cpu"):
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{args.model} built a {type(model).__name__}, not an nn.Module")
    optimizer = None
    if args.optimizer:
        cls = getattr(torch.optim, args.optimizer, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"torch.optim has no optimizer {args.optimizer!r}")
        optimizer = cls(model.parameters())
    if args.batch:
        return model, make_batch(args.batch, min(4, args.global_batch_size)), optimizer
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(f"pass --batch (one sample's tensors, e.g. long:64 long:64): {args.model} has no "
                         f"example_input_array")  # fmt: skip
    return model, example, optimizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        budget = parse_bytes(args.memory)
        model, batch, optimizer = build(args)
        step = None if args.batch else (lambda module, b: module(b))
        candidates, facts = [], None
        for tp in args.tensor_parallel_sizes:
            # Each tensor-parallel size is measured on one tp rank's local model (memory/tensor_parallel).
            found = measure_model(model, batch, args.precision, optimizer, tensor_parallel_size=tp,
                                  **({"step": step} if step else {}))  # fmt: skip
            facts = facts or found
            configs = candidate_plans(
                args.devices,
                len(found.layout.blocks()),
                args.global_batch_size,
                args.precision,
                args.pipeline_sizes,
                tuple(args.schedules),
                fsdp=found.layout.kind == "sequential",  # FSDP2 shards the stages of a split Sequential
                tensor_parallel_size=tp,
            )
            candidates += rank_plans(found, configs, args.global_batch_size)
        assert facts is not None
        blocks = len(facts.layout.blocks())
        if not candidates:
            raise ValueError(f"no configuration divides the global batch ({args.global_batch_size}) evenly "
                             f"over {args.devices} devices: use a multiple of {args.devices}")  # fmt: skip
        candidates = ranked(candidates)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    params = sum(t.numel for t in facts.tensors.values())
    print(
        f"{args.model}: {params:,} parameters, {blocks} pipeline units ({facts.layout.kind} "
        f"`{facts.layout.container}`); global batch {args.global_batch_size}, {args.devices} devices, "
        f"{args.precision}, budget {format_bytes(budget)} per device\n"
    )
    print(format_plan(candidates, budget))
    best = fastest_fit(candidates, budget)
    if best is None:
        smallest = min(candidates, key=lambda c: c.peak)
        print(f"\nnothing fits {format_bytes(budget)}: the smallest peak is {format_bytes(smallest.peak)} "
              f"({smallest.plan.label()}); add devices, use bf16 or fp16, or shrink the batch")  # fmt: skip
        return 1
    print(f"\nfastest that fits {format_bytes(budget)}: {best.plan.label()} (est. time {best.time:.2f})")
    print(best.estimate.format_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
