"""``python -m lightning_parallel.planner``: will this model fit N devices, which plan is fastest, how?

    python -m lightning_parallel.planner experiments/train_charlm.py:CharLM --init dim=256 depth=8 \\
        --batch long:64 long:64 --global-batch-size 64 --devices 4 --memory 24GiB --optimizer AdamW

The model is ``file.py:Class`` or ``package.module:Class`` (any callable returning an ``nn.Module``),
built with the ``--init`` keyword arguments (on the meta device with ``--meta``, for models too large
for this machine: then sized, not timed, and the plan chosen is the most frugal that fits, not the
fastest). ``--batch`` gives the tensors of one sample as ``dtype:shape`` (integers are zeros,
floating tensors random), the training step sees them as a tuple;
without it the module's ``example_input_array`` is fed to ``forward`` (no loss). Prints one table of
the ``PipelineStrategy`` plans (pipeline shapes x schedules x micro-batches x recomputation x
data-parallel modes x offload), each rank's device peak and each node's host bytes against
``--memory`` and ``--host-memory`` (less ``--margin``), and the predicted step time (the schedule
simulated with each unit's forward and backward timed here, the links measured on this machine's
loopback or given with ``--bandwidth``/``--latency``); then the fastest plan that fits, as the
``PipelineStrategy(...)`` line to paste, and the next ones with the reason for each. The arguments
mean what ``PipelineStrategy(plan="auto", memory=..., host_memory=..., global_batch_size=...)`` takes
(:mod:`lightning_parallel.planner.ranking`, :mod:`lightning_parallel.planner.time_model`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_parallel.distributed.link_timing import time_loopback
from lightning_parallel.layout.choices import PRECISIONS
from lightning_parallel.planner import longest
from lightning_parallel.planner.advice import NothingFits, choose
from lightning_parallel.planner.links import Link, Links, given_links, links_from
from lightning_parallel.planner.quantities import host_memory, parse_bytes, parse_rate, parse_seconds
from lightning_parallel.planner.ranking import (
    MARGIN,
    Budget,
    format_choice,
    format_plan,
    measure_for,
    plan_search,
)
from lightning_parallel.planner.search import SEARCHED_SCHEDULES, Search
from lightning_parallel.planner.units import find_units
from lightning_parallel.techniques import search_options
from lightning_parallel.techniques.contract import SearchOption
from lightning_parallel.techniques.offload.disk_rate import disk_bandwidth

__all__ = ["main", "parse_bytes"]


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
        prog="python -m lightning_parallel.planner", description=__doc__,
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
    p.add_argument("--batch-size", type=int, help="one replica's batch, as its dataloader yields it "
                   "(default: the global batch / the replicas, no accumulation)")  # fmt: skip
    p.add_argument("--devices", type=int, required=True, help="devices in all")
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over (default 1)")
    p.add_argument("--memory", required=True, help="memory per device, e.g. 24GiB, 80GB")
    p.add_argument(
        "--host-memory", help="host memory per node, shared by its ranks (default: this machine's)"
    )
    p.add_argument("--margin", type=float, default=MARGIN, help=f"safety margin (default {MARGIN})")
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS), help="(default 32-true)")
    p.add_argument("--optimizer", help="a torch.optim class, when configure_optimizers needs a Trainer")
    p.add_argument("--pipeline-sizes", type=int, nargs="*", help="pipeline sizes to try (default: divisors)")
    p.add_argument("--schedules", nargs="*", default=list(SEARCHED_SCHEDULES), choices=SEARCHED_SCHEDULES)
    p.add_argument(
        "--tensor-parallel-sizes", type=int, nargs="+", default=[1],
        help="tensor-parallel sizes to try (default 1: none), e.g. 1 2 4",
    )  # fmt: skip
    for option in search_options():  # (each technique's, in the list's order)
        add_option_flag(p, option)
    p.add_argument("--disk-memory", help="disk room per node under --offload-dir, e.g. 2TB (default: the "
                   "free space there, where it exists)")  # fmt: skip
    p.add_argument("--disk-bandwidth", help="the disk's read or write rate, e.g. 3GB/s (default: measured "
                   "in --offload-dir, where it exists)")  # fmt: skip
    p.add_argument("--bandwidth", help="link bandwidth between ranks, e.g. 25GB/s (default: measured here)")
    p.add_argument("--latency", default="0us", help="link latency with --bandwidth, e.g. 10us")
    p.add_argument("--host-bandwidth", help="device<->host copy rate, e.g. 20GB/s (default: measured here)")
    p.add_argument("--rows", type=int, default=25, help="table rows to print (0: all; default 25)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (large models): "
                   "sized, not timed; the plan chosen is then the most frugal that fits")  # fmt: skip
    longest.add_arguments(p)  # (the sequence-length axis: planner/longest.py)
    return p.parse_args(argv)


def add_option_flag(parser: argparse.ArgumentParser, option: SearchOption) -> None:
    """``option``'s flag (none where its ``flag`` is None): its words (``choices``), a switch to ``not
    default`` (a bool default) or one value (of ``option.type``); :func:`option_values` reads it back."""
    if option.flag is None:
        return
    if option.choices is not None:
        words = list(option.choices)
        default = next(w for w, value in option.choices.items() if value == option.default)
        parser.add_argument(option.flag, dest=option.name, choices=words, default=default, help=option.help)
    elif isinstance(option.default, bool):
        parser.add_argument(option.flag, dest=option.name, action="store_const", const=not option.default,
                            default=option.default, help=option.help)  # fmt: skip
    else:
        parser.add_argument(option.flag, dest=option.name, type=option.type, default=option.default,
                            help=option.help)  # fmt: skip


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The techniques' search options as the flags give them (``Search(options=...)``)."""
    out = {}
    for option in search_options():
        if option.flag is not None:
            given = getattr(args, option.name)
            out[option.name] = option.choices[given] if option.choices is not None else given
    return out


def build(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The model and the optimizer override from the arguments."""
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
    return model, optimizer


def probe_batch(args: argparse.Namespace, model: nn.Module, samples: int) -> Any:
    """``samples`` samples of ``--batch`` (the largest micro-batch the plans run), or the example input."""
    if args.batch:
        return make_batch(args.batch, samples)
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(f"pass --batch (one sample's tensors, e.g. long:64 long:64): {args.model} has no "
                         f"example_input_array")  # fmt: skip
    return example


def search_of(args: argparse.Namespace) -> tuple[Search, Budget]:
    """The search and the budget the arguments describe (as ``PipelineStrategy(plan="auto")`` builds them)."""
    if args.nodes < 1 or args.devices % args.nodes:
        raise ValueError(f"--nodes ({args.nodes}) must divide --devices ({args.devices})")
    search = Search(
        args.devices, args.global_batch_size, args.batch_size, args.precision,
        tuple(args.pipeline_sizes) if args.pipeline_sizes else None, tuple(args.schedules),
        tuple(args.tensor_parallel_sizes), args.devices // args.nodes, options=option_values(args),
    )  # fmt: skip
    host = parse_bytes(args.host_memory) if args.host_memory else host_memory()
    budget = Budget(parse_bytes(args.memory), host, search.node_ranks, args.margin, _disk_room(args))
    return search, budget


def _disk_room(args: argparse.Namespace) -> int | None:
    """``--disk-memory``, else the free space under ``--offload-dir`` where it exists (None: unchecked)."""
    if args.disk_memory:
        return parse_bytes(args.disk_memory)
    if args.offload_dir and os.path.isdir(args.offload_dir):
        return shutil.disk_usage(args.offload_dir).free
    return None


def links_of(args: argparse.Namespace) -> Links:
    """Given (``--bandwidth``, ``--latency``, ``--host-bandwidth``, ``--disk-bandwidth``) or measured on this
    machine (the disk in ``--offload-dir``, where it exists)."""
    if args.bandwidth:
        host = parse_rate(args.host_bandwidth) if args.host_bandwidth else None
        links = given_links(parse_rate(args.bandwidth), parse_seconds(args.latency), host)
    else:
        links = links_from(time_loopback(), "measured on this machine's loopback")
        if args.host_bandwidth:
            links = replace(links, host=given_links(parse_rate(args.host_bandwidth)).host)
    if args.disk_bandwidth:
        return replace(links, disk=Link(0.0, parse_rate(args.disk_bandwidth)))
    if args.offload_dir and os.path.isdir(args.offload_dir):
        return replace(links, disk=Link(0.0, disk_bandwidth(args.offload_dir)))
    return links


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        search, budget = search_of(args)
        model, optimizer = build(args)
        layout = find_units(model)
        unsplit = search.split_error(layout.max_stages)
        if unsplit:
            raise ValueError(unsplit)
        if longest.wanted(args):
            return longest.run(args, search, budget, model, optimizer, make_batch, lambda: links_of(args))
        batch = probe_batch(args, model, search.micro_batch_sizes(layout.max_stages)[1])
        step = {} if args.batch else {"step": lambda module, b: module(b)}
        facts = measure_for(model, batch, search, optimizer, **step)
        links = links_of(args)
        candidates = plan_search(facts, search, links)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    first = facts[search.tensor_parallel_sizes[0]]
    params = sum(t.numel for t in first.tensors.values())
    print(
        f"{args.model}: {params:,} parameters, {first.layout.describe()}; global batch "
        f"{args.global_batch_size}, {args.devices} devices, {args.precision}; budget {budget.describe()}"
    )
    print(_timing_line(first, links) + "\n")
    shown = candidates if args.rows <= 0 else candidates[: args.rows]
    print(format_plan(shown, budget))
    if len(shown) < len(candidates):
        print(f"... and {len(candidates) - len(shown)} more (--rows 0 shows all)")
    try:
        best = choose(facts, search, budget, links, candidates)
    except NothingFits as err:
        print(f"\n{err}")
        return 1
    print("\n" + format_choice(candidates, budget))
    print(best.estimate.format_table())
    return 0


def _timing_line(facts: Any, links: Links) -> str:
    if facts.times is None:
        return (
            "not timed (a model on the meta device): plans ranked by their device peak, so the chosen one "
            "is the most frugal that fits, not the fastest (run without --meta where the model fits this "
            "machine to rank by time)"
        )
    small, large = facts.times.sizes[0], facts.times.sizes[-1]
    where = f"units timed here ({facts.times.device}) at micro-batches of {small} and {large}"
    return f"step times: {where}; {links.describe()}"


if __name__ == "__main__":
    sys.exit(main())
