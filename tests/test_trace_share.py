"""sources/traced/share.py: one rank exports the traced forward, the others cut the same stages from its
program.

In one process, a stand-in for the group plays the receiving rank: the program is exported, packed and
loaded back as a receiver loads it, and the stages cut from it are compared with a local trace's, graph
by graph and on real weights. Two gloo ranks then share for real: one export for both, a failure on the
exporting rank raised on both, a rank whose model or settings differ refused on both, and the bytes on a
gloo twin of a group whose backend takes no CPU tensors.

Covers distributed/host_group.py (the gloo twin; the backend the device mesh's groups get).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo
from tiny_models import DeviceAwareGPT, TinyGPT
from torch import nn

import lightning_parallel.sources.traced.share as share_module
from lightning_parallel.distributed.host_group import group_backend, host_group, runs_cpu_tensors
from lightning_parallel.sources.traced.errors import EXPORT, PipelineTraceError, TraceStepFailed, explain
from lightning_parallel.sources.traced.share import (
    SHARE_ENV,
    ProgramShare,
    fingerprint,
    refuse_mismatch,
    tally,
)
from lightning_parallel.sources.traced.stages import TracedStages
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch
TOKENS = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(0))


class Receiving(ProgramShare):
    """This process in a receiving rank's place: the program is exported here (as the exporting rank
    would), packed, and loaded back as a receiver loads it. ``sent``: load these bytes instead."""

    is_src = False

    def __init__(self, sent: bytes | None = None) -> None:
        self.group, self.src, self.ranks, self.sent = None, 0, [0], sent

    def gather(self, obj):
        return [obj]

    def decide(self, fn):
        if self.sent is None:
            self.sent = fn()
        return self.sent

    def together(self):
        return contextlib.nullcontext()


def stage_texts(pipe) -> list[str]:
    """Every stage's graphs, node by node with the value each node's metadata records."""

    def val(v):
        if torch.is_tensor(v):
            return f"{v.dtype}{tuple(v.shape)}@{v.device}"
        return repr(v)

    texts = []
    for i in range(pipe.num_stages):
        for name, gm in pipe.get_stage_module(i).named_modules():
            if hasattr(gm, "graph"):
                nodes = [f"{n.format_node()} :: {val(n.meta.get('val'))}" for n in gm.graph.nodes]
                texts.append(f"stage {i} {name}\n" + "\n".join(nodes))
    return texts


def _pipe_facts(pipe) -> tuple:
    return stage_texts(pipe), str(pipe.size_constraints), pipe.dynamic_failure


def test_a_received_program_cuts_the_stages_a_local_export_cuts():
    twin = meta_twin(TinyGPT(depth=4))
    example = to_meta((TOKENS,))
    before = dataclasses.replace(tally)
    local = trace(twin, example, ["h.2"], train=True)
    received = trace(twin, example, ["h.2"], train=True, share=Receiving())
    assert _pipe_facts(received) == _pipe_facts(local)
    assert (tally.exported, tally.received) == (before.exported + 2, before.received + 1)
    # The stages hold the twin's own meta tensors where a local trace's do (a tied weight's replica aside).
    assert _held(received, twin) == _held(local, twin)
    assert received.get_stage_module(0).get_submodule("h.0.ln_1").weight is twin.h[0].ln_1.weight


def _held(pipe, twin) -> list[tuple[str, str | None]]:
    """Each stage tensor's name, and the twin's name for it if it is the twin's tensor itself."""
    names = {id(t): n for n, t in [*twin.named_parameters(), *twin.named_buffers()]}
    return [
        (n, names.get(id(t))) for n, t in [*pipe.split_gm.named_parameters(), *pipe.split_gm.named_buffers()]
    ]


def test_stages_built_from_received_programs_compute_what_the_model_computes():
    """Every trace of TracedStages (the planning one, each new mode) received: same stages, same numbers."""
    torch.manual_seed(0)
    model = TinyGPT(depth=2)
    _one_process_group()
    built = {}
    for name, share in [("local", None), ("received", Receiving)]:
        stages = TracedStages(meta_twin(model), [], [0], model, alias_table(model), torch.device("cpu"), None,
                              share=share() if share else None)  # fmt: skip
        built[name] = [stages.build(mode, 1, (torch.randint(0, 13, (3, 5)),)) for mode in ("train", "eval")]
        assert stages.traces == 2
    for (local,), (received,) in zip(built["local"], built["received"], strict=True):
        tokens = torch.randint(0, 13, (3, 5))
        assert torch.equal(received.submod(tokens), local.submod(tokens))
        torch.testing.assert_close(received.submod(tokens), model(tokens))


def test_a_program_exported_for_another_gpu_is_moved_to_this_ranks():
    """Exported for (fake) cuda:0, received on cuda:1: the stages cuda:1's own export would cut."""
    twin = meta_twin(DeviceAwareGPT(depth=2))
    example = to_meta((TOKENS,))
    on_0 = Receiving()
    trace(twin, example, ["h.1"], train=True, device="cuda:0", share=on_0)
    moved = trace(twin, example, ["h.1"], train=True, device="cuda:1", share=Receiving(on_0.sent))
    own = trace(twin, example, ["h.1"], train=True, device="cuda:1")
    assert _pipe_facts(moved) == _pipe_facts(own)
    assert "cuda:1" in "".join(stage_texts(moved)) and "cuda:0" not in "".join(stage_texts(moved))
    assert all(t.is_meta for t in [*moved.split_gm.parameters(), *moved.split_gm.buffers()])


def test_hugging_face_llama_received_program_equals_the_local_export():
    hf_models = pytest.importorskip("hf_models")  # (transformers, from .hf_packages)
    from lightning_parallel.sources.traced.call_binding import CallBinding

    torch.manual_seed(0)
    model = hf_models.HFCausalLM("llama", tied=True)
    twin = meta_twin(model)
    (binding, tensors), (receiving, _) = [CallBinding.of("model", (), {"input_ids": TOKENS}) for _ in "ab"]
    example = to_meta(tensors)
    local = trace(twin, example, ["model.model.layers.2"], True, binding)
    received = trace(twin, example, ["model.model.layers.2"], True, receiving, share=Receiving())
    assert _pipe_facts(received) == _pipe_facts(local)
    # What the export learned running forward travels too: the call returns a ModelOutput.
    assert receiving.out_spec == binding.out_spec and "CausalLMOutputWithPast" in str(binding.out_spec)


def test_a_rank_whose_fingerprint_differs_is_named_with_the_difference():
    twin, example = meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,))
    mine = fingerprint(twin, example, {"mode": "train"})
    assert mine == fingerprint(meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,)), {"mode": "train"})
    others = {
        "parameters and buffers": fingerprint(
            meta_twin(TinyGPT(depth=2, dim=16, heads=2)), example, {"mode": "train"}
        ),
        "input": fingerprint(twin, to_meta((TOKENS[:, :5],)), {"mode": "train"}),
        "mode": fingerprint(twin, example, {"mode": "eval"}),
        "model": fingerprint(meta_twin(DeviceAwareGPT(depth=2)), example, {"mode": "train"}),
        "torch": {**mine, "torch": "2.12.0"},
    }
    share = Receiving()
    share.ranks = [0, 1]
    refuse_mismatch([mine, dict(mine)], share)
    for field, theirs in others.items():
        assert theirs[field] != mine[field], field
        with pytest.raises(
            ValueError, match=f"global rank 1 differs from it \\({field}: .* on rank 0, .* on rank 1"
        ):
            refuse_mismatch([mine, theirs], share)


def test_a_program_that_does_not_pickle_is_exported_on_every_rank(monkeypatch):
    def refuse(*_):
        raise TypeError("cannot pickle a model's object")

    monkeypatch.setattr(share_module, "pack", refuse)
    twin, example = meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,))
    before = dataclasses.replace(tally)
    with pytest.warns(
        UserWarning, match="did not pickle .*cannot pickle a model's object.*: each rank exports"
    ):
        received = trace(twin, example, [], train=True, share=Receiving())
    # (this process played both ranks: the exporting one's export, then the receiving one's own)
    assert (tally.exported, tally.received) == (before.exported + 2, before.received)
    assert _pipe_facts(received) == _pipe_facts(trace(twin, example, [], train=True))


def test_a_failed_step_pickles_as_itself():
    failed = pickle.loads(pickle.dumps(TraceStepFailed(EXPORT, ValueError("branch on a value"))))
    assert isinstance(failed, TraceStepFailed) and failed.step == EXPORT
    assert str(failed) == f"{EXPORT}: ValueError: branch on a value"


def test_nothing_is_shared_in_a_world_of_one(one_rank):
    assert ProgramShare.over(None) is None
    assert host_group(None) is None  # gloo runs CPU tensors: the group itself


def test_the_mesh_gets_a_host_backend_only_where_host_tensors_meet_a_group_without_one(one_rank, monkeypatch):
    assert runs_cpu_tensors() and group_backend("cuda", host_tensors=True) is None  # (gloo takes them)
    # A process group started with NCCL alone (by hand, or by an earlier fit in this process).
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert not runs_cpu_tensors()
    assert group_backend("cuda", host_tensors=True) == "cuda:nccl,cpu:gloo"
    assert group_backend("cuda", host_tensors=False) is None and group_backend("cpu", True) is None


def _one_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# ------------------------------------------------------------------------------- two gloo ranks


class ValueBranch(nn.Module):
    """A forward that branches on a value: torch.export cannot capture it (on any rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as err:
        return (type(err).__name__, str(err), list(getattr(err, "__notes__", [])))


def _shared_and_own(rank: int) -> dict:
    torch.manual_seed(0)
    twin, example = meta_twin(TinyGPT(depth=4)), to_meta((TOKENS,))
    before = dataclasses.replace(tally)
    shared = trace(twin, example, ["h.2"], train=True, share=ProgramShare.over(None))
    counts = (tally.exported - before.exported, tally.received - before.received)
    own = trace(twin, example, ["h.2"], train=True)  # (each rank exports its own: the reference)
    return {"shared": _pipe_facts(shared), "own": _pipe_facts(own), "counts": counts}


def _failures(rank: int) -> dict:
    share = ProgramShare.over(None)
    example = to_meta((torch.ones(2, 4),))
    before = tally.exported
    explained = lambda failed: explain(failed, "ValueBranch.forward", note="not checked")  # noqa: E731
    out = {"failed": _outcome(lambda: trace(meta_twin(ValueBranch()), example, [], True, share=share,
                                            explain=explained))}  # fmt: skip
    out["exported_for_failure"] = tally.exported - before
    other = TinyGPT(depth=4, dim=8 if rank == 0 else 16)
    out["other_model"] = _outcome(
        lambda: trace(meta_twin(other), to_meta((TOKENS,)), ["h.2"], True, share=share)
    )
    os.environ[SHARE_ENV] = "0" if rank == 1 else "1"
    out["other_switch"] = _outcome(
        lambda: trace(meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,)), [], True, share=share)
    )
    os.environ[SHARE_ENV] = "0"  # (on both: each exports its own, the fingerprints still compared)
    before = tally.exported
    trace(meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,)), [], True, share=share)
    out["switched_off_exports"] = tally.exported - before
    del os.environ[SHARE_ENV]
    return out


def _without_cpu_backend(rank: int) -> dict:
    """A default group whose backend takes no CPU tensors (as NCCL): the bytes go over a gloo twin."""
    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cuda:nccl" if group is None else real(group)
    try:
        share = ProgramShare.over(None)
        twin, example = meta_twin(TinyGPT(depth=2)), to_meta((TOKENS,))
        before = tally.received
        pipe = trace(twin, example, ["h.1"], train=True, share=share)
        return {"twin": share.group is not None and share.ranks == [0, 1], "texts": stage_texts(pipe),
                "received": tally.received - before}  # fmt: skip
    finally:
        dist.get_backend_config = real


def _worker(rank: int, world: int, out_dir: str) -> None:
    results = {**_shared_and_own(rank), **_failures(rank), **_without_cpu_backend(rank)}
    t = torch.ones(1)
    dist.all_reduce(t)  # after every failure: no rank was left inside a collective
    results["still_in_step"] = float(t)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_ranks_share_one_export_and_fail_or_refuse_together(tmp_path):
    r0, r1 = spawn_gloo(_worker, 2, tmp_path)
    # One export for both ranks; each cut the stages its own export cuts.
    assert r0["counts"] == (1, 0) and r1["counts"] == (0, 1)
    assert r0["shared"] == r0["own"] == r1["shared"] == r1["own"]
    # The exporting rank's failure, explained there, is every rank's; the other rank exported nothing.
    assert r0["failed"][0] == r1["failed"][0] == PipelineTraceError.__name__
    assert r0["failed"][1] == r1["failed"][1] and "ValueBranch.forward" in r0["failed"][1]
    assert r1["failed"][2] == ["raised on global rank 0; this rank stops with it"]
    assert r0["exported_for_failure"] == 1 and r1["exported_for_failure"] == 0
    # A rank with another model, or another switch, is refused on both ranks with the difference.
    for key, field in [("other_model", "parameters and buffers"), ("other_switch", "sharing")]:
        assert r0[key][:2] == r1[key][:2] and r0[key][0] == "ValueError", r0[key]
        assert f"global rank 1 differs from it ({field}: " in r0[key][1], r0[key][1]
    assert (
        "the first tensor that differs: 'wte.weight (13, 8) torch.float32' on rank 0, 'wte.weight (13, 16)"
        in (r0["other_model"][1])
    )
    assert r0["switched_off_exports"] == r1["switched_off_exports"] == 1
    # A group whose backend takes no CPU tensors: the program travels on a gloo twin of it.
    assert r0["twin"] and r1["twin"] and r1["received"] == 1 and r0["texts"] == r1["texts"]
    assert r0["still_in_step"] == r1["still_in_step"] == 2.0
