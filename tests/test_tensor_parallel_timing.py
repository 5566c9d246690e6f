"""Tensor parallelism's in-place measurement (``techniques/tensor_parallel/timing.py``): a traced model's
block is timed as its traced stage runs it, the exported graph on DTensors, not the eager block."""

from __future__ import annotations

import torch
from tiny_tp_models import SplitQkvTinyGPT
from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel.planner.facts import planned_tensors
from lightning_parallel.techniques.ledgers import TimeBench, UnitSample
from lightning_parallel.techniques.tensor_parallel import traced
from lightning_parallel.techniques.tensor_parallel.technique import measure_block


def _block_and_bench(layout: str) -> tuple[UnitSample, object, TimeBench]:
    torch.manual_seed(0)
    model = SplitQkvTinyGPT(dim=16, heads=4)
    x = torch.randn(2, 8, 16, requires_grad=True)
    sample = UnitSample("h.0", model.h[0], {2: ((x,), {})})
    bench = TimeBench(ranks=1, device=torch.device("cpu"), layout=layout, repeats=1,
                      dtensor_rules=traced.register_missing_shardings)  # fmt: skip
    return sample, planned_tensors(model, 2), bench


def _recording(monkeypatch) -> list[tuple[torch.nn.Module, object]]:
    """Each graph ``TensorParallelGraph`` runs on DTensors, with its output (a traced stage's path)."""
    seen, run = [], traced.run_on_dtensors

    def recorded(graph, args, mesh, slots):
        out = run(graph, args, mesh, slots)
        seen.append((graph, out))
        return out

    monkeypatch.setattr(traced, "run_on_dtensors", recorded)
    return seen


def test_a_traced_block_is_timed_as_its_exported_graph_on_dtensors(one_rank, monkeypatch):
    seen = _recording(monkeypatch)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"]
    sample, plan, bench = _block_and_bench("blocks")
    times = measure_block(sample, plan, mesh, bench)
    assert times.forward.at(2) > 0 and times.note == ""
    # Forward, forward + backward and the recomputed one, each a warm-up and a repeat: the block's graph.
    assert len(seen) == 6
    graph, out = seen[0]
    nodes = [n for m in graph.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)
             for n in m.graph.nodes]  # fmt: skip
    # Run as the traced source runs its stages: generated code, not the fx interpreter node by node.
    flags = [m._run_with_interpreter for m in graph.modules() if hasattr(m, "_run_with_interpreter")]
    assert flags and not any(flags)
    # The layouts written around each of the six split Linear layers' ops, as a traced stage's are.
    assert sum(n.target is traced.to_layout for n in nodes) == 2 * 6
    torch.testing.assert_close(out, sample.module(*sample.inputs[2][0]))
    # A split Sequential's stage calls its modules: so is its block timed.
    seen.clear()
    measure_block(sample, plan, mesh, _block_and_bench("sequential")[2])
    assert seen == []


def test_a_block_export_cannot_capture_is_timed_eagerly_and_says_so(one_rank, monkeypatch):
    seen = _recording(monkeypatch)

    def refused(*args, **kwargs):
        raise RuntimeError("no graph")

    monkeypatch.setattr(torch.export, "export", refused)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"]
    sample, plan, bench = _block_and_bench("blocks")
    times = measure_block(sample, plan, mesh, bench)
    assert times.note == "a block timed eagerly (export failed: RuntimeError: no graph)" and seen == []
    assert times.forward.at(2) > 0
