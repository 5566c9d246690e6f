"""A traced stage sharded with FSDP2 as one root: the user's modules held, the current export graph run.

A traced stage is an export graph that reads its weights with ``get_attr``: it never calls the user's
blocks, so FSDP hooks put on them would never all-gather them. There the FSDP unit is
:class:`ShardedTracedStage`, a root that holds the user's modules (the same objects, under the same
names) and runs the current input shape's graph: its pre-forward hook all-gathers the whole stage and
``forward`` points the graph's attributes at the unsharded parameters, so the graph reads full weights
and autograd puts its gradients where FSDP reduce-scatters them. The stage stays unsharded for the whole
step (``reshard_after_forward=False``): one all-gather per step per stage, so per-block units would save
no memory there. Apart from ``sharding.py`` (a stage module's blocks) because only the traced source
needs it, and it is a module of its own with its own state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy, fully_shard

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource


def shard_traced(stages: StageSource, mesh: DeviceMesh, offload_policy: OffloadPolicy | None = None) -> None:
    """Shard the module holding this rank's traced stage as one FSDP2 root, in its place in the view's
    ``modules``; each stage then runs through the root, which is told before each schedule steps which
    graph it runs (that schedule's program: shapes differ).

    Example::

        shard_traced(runner.stages, mesh.data_parallel_mesh())
    """
    [held] = stages.modules  # (one stage per rank: refused otherwise before the split)
    root = shard_traced_stage(ShardedTracedStage(held), mesh, offload_policy)
    stages.modules[0] = root

    def run_through_root(stage: PreparedStage) -> None:
        runs = stage.module if stage.runs is None else stage.runs
        links = root.links(stage.module, stages.aliases)
        stage.runs, stage.activate = root, functools.partial(root.use_graph, runs, links)

    stages.each_stage(run_through_root)


# (the graph's slot dict, its name there, the root's slot dict, the name there)
_Link = tuple[dict[str, Any], str, dict[str, Any], str]


class ShardedTracedStage(nn.Module):
    """The FSDP root of one traced stage: holds the user's modules, runs the current export graph.

    Args:
        module: the user's module, pruned to this rank's stage; its children are held as they are
            (shared, so the user's module sees the sharded parameters FSDP puts in their place) and
            its own parameters are registered here too (and put back in it after sharding).

    Example::

        root = ShardedTracedStage(pruned_gpt)
        shard_traced_stage(root, mesh.device_mesh["dp_shard"])
        root.use_graph(stage_graph, root.links(stage_graph, aliases))   # this input shape's graph
        # (or what runs the graph: a tensor-parallel stage's wrapper, which runs it on DTensors)
        root(x)                                 # all-gathers the stage, runs the graph
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._owner = [module]  # a list: not registered as a submodule (it is the LightningModule)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, param in module._parameters.items():
            if param is not None:
                self.register_parameter(name, param)
        self._graph: nn.Module | None = None  # what runs the current graph (not a submodule)
        self._links: list[_Link] = []

    def links(self, graph: nn.Module, aliases: Mapping[str, str]) -> list[_Link]:
        """Where each parameter attribute of ``graph`` takes its tensor from in this root (by canonical
        name): computed once per graph, followed at every forward."""
        mine: dict[str, tuple[dict[str, Any], str]] = {}
        for path, _ in self.named_parameters(remove_duplicate=False):
            owner, _, leaf = path.rpartition(".")
            mine[aliases.get(path, path)] = (self.get_submodule(owner)._parameters, leaf)
        links = []
        for path, _ in graph.named_parameters(remove_duplicate=False):
            owner, _, leaf = path.rpartition(".")
            slot, name = mine[aliases.get(path, path)]
            links.append((graph.get_submodule(owner)._parameters, leaf, slot, name))
        return links

    def use_graph(self, runs: nn.Module, links: list[_Link]) -> None:
        """Run ``runs`` (a stage graph, or a module running it) from now on, the graph's parameter
        attributes following ``links`` (:meth:`links`)."""
        self.__dict__["_graph"], self._links = runs, links

    def forward(self, *args: Any) -> Any:
        if self._graph is None:
            raise RuntimeError("internal error: a sharded traced stage ran before use_graph")
        # FSDP's pre-forward has just set the unsharded parameters on the held modules.
        for graph_slot, graph_name, slot, name in self._links:
            graph_slot[graph_name] = slot[name]
        return self._graph(*args)

    def restore_owner_parameters(self) -> None:
        """Give the user's module the (sharded) parameters FSDP registered here in place of its own."""
        owner = self._owner[0]
        for name in list(owner._parameters):
            if name in self._parameters:
                owner._parameters[name] = self._parameters[name]


def shard_traced_stage(
    root: ShardedTracedStage, mesh: DeviceMesh, offload_policy: OffloadPolicy | None = None
) -> ShardedTracedStage:
    """``fully_shard`` the root over ``mesh`` (one unit per stage; see the module's docstring), with
    FSDP2's ``offload_policy`` (``CPUOffloadPolicy``: the shards on the host).

    Example::

        shard_traced_stage(ShardedTracedStage(pruned_module), mesh.data_parallel_mesh())
    """
    fully_shard(
        root, mesh=mesh, reshard_after_forward=False, offload_policy=offload_policy or OffloadPolicy()
    )
    root.restore_owner_parameters()
    return root
