"""sources/traced/trace.py, sources/traced/split.py and sources/traced/stages.py: a module's forward traced
on a meta twin, split at its blocks, and this rank's stages built from it.

The twin is traced as fake tensors of the stages' device: a CPU trace takes the CPU's branches, and a
trace for ``cuda:0`` (fake, no GPU needed) the CUDA ones.

One process. torch.export takes ~1 s per trace here, so the tests share one traced pipe.

Covers sources/export.py (export_for_pipeline: dynamic sizes, the static fallback and its reason) through
TracedStages.
"""

import pytest
import torch
import torch.distributed as dist
from tiny_models import DeviceAwareGPT, TinyGPT
from torch import nn

from lightning_parallel.pipeline.blocks import find_block_list
from lightning_parallel.sources.traced.split import block_entry, block_extras, check_split_points, keep_only
from lightning_parallel.sources.traced.stage_graphs import point_at, stage_contents
from lightning_parallel.sources.traced.stages import TracedStages
from lightning_parallel.sources.traced.trace import call_order, trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch
TOKENS = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(depth=4)
    twin = meta_twin(model)
    example = to_meta((TOKENS,))
    return model, twin, example, call_order(twin, example)


@pytest.fixture(scope="module")
def contents(gpt):
    _, twin, example, _ = gpt
    return stage_contents(trace(twin, example, ["h.2"], train=False))


def _tensors(module):
    return [*module.parameters(), *module.buffers()]


def test_meta_twin_keeps_the_structure_and_ties_and_shares_no_tensor():
    model = TinyGPT(depth=2)
    model.h[0].register_buffer("scale", torch.ones(3))
    model.h[1].register_buffer(
        "scale", model.h[0].scale
    )  # a buffer reached twice: the twin keeps one tensor too
    model.wpe.weight.requires_grad_(False)
    twin = meta_twin(model)
    assert type(twin) is TinyGPT and twin is not model and twin.h[0] is not model.h[0]
    assert twin.lm_head.weight is twin.wte.weight and twin.h[1].scale is twin.h[0].scale
    assert isinstance(twin.wte.weight, nn.Parameter) and not twin.wpe.weight.requires_grad
    assert all(t.is_meta for t in _tensors(twin)) and not any(t.is_meta for t in _tensors(model))
    assert not {id(t) for t in _tensors(twin)} & {id(t) for t in _tensors(model)}
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [(t.shape, t.dtype) for t in twin.state_dict().values()] == [
        (t.shape, t.dtype) for t in model.state_dict().values()
    ]
    twin.eval()
    assert model.training  # each submodule is a copy: switching the twin's mode leaves the model's


def test_to_meta_replaces_tensors_by_shape_and_dtype_only():
    out = to_meta({"ids": (TOKENS, 3), "mask": torch.ones(2, dtype=torch.bool), "name": "x"})
    ids, three = out["ids"]
    assert ids.is_meta and ids.shape == TOKENS.shape and ids.dtype == torch.long and three == 3
    assert out["mask"].is_meta and out["mask"].dtype == torch.bool and out["name"] == "x"
    assert not TOKENS.is_meta


def test_call_order_lists_modules_as_forward_first_calls_them(gpt):
    _, twin, _, order = gpt
    assert order[:4] == ["wte", "wpe", "h.0", "h.0.ln_1"] and order[-3:] == ["h.3.mlp.2", "ln_f", "lm_head"]
    assert order.index("h.1") < order.index("h.2") and len(order) == len(set(order))
    with pytest.raises(
        ValueError, match=r"TinyGPT\.forward failed on inputs of shapes \[\(4,\)\] .*IndexError: tuple index"
    ):
        call_order(twin, to_meta((TOKENS[0, :4],)))
    assert not any(m._forward_pre_hooks for m in twin.modules())  # the hooks go, also after a failure


def test_stage_contents_name_calls_and_the_tensors_each_stage_reads(gpt, contents):
    model = gpt[0]
    assert [c.calls for c in contents] == [("wte", "wpe", "h.0", "h.1"), ("h.2", "h.3", "ln_f", "lm_head")]
    first, last = (c.tensors for c in contents)
    assert {"wte.weight", "wpe.weight", "h.1.mlp.2.bias"} <= first and "lm_head.weight" not in first
    # The head reads the tied weight under its own name; alias_table maps it to wte.weight.
    assert {"lm_head.weight", "ln_f.bias", "h.2.attn.qkv.weight"} <= last and "wte.weight" not in last
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert first | last == all_names and not first & last
    assert model.training  # the twin was traced in eval mode: the model's own mode is untouched


def test_tracing_again_undoes_the_patches_and_point_at_uses_the_real_tensors(gpt, contents):
    _, twin, example, _ = gpt
    assert not {"forward", "_orig_forward"} & set(vars(twin.h[2]))
    pipe = trace(twin, example, ["h.1", "h.3"], train=True)
    assert pipe.num_stages == 3 and not {"forward", "_orig_forward"} & set(vars(twin.h[1]))
    assert [c.calls for c in stage_contents(pipe)] == [
        ("wte", "wpe", "h.0"), ("h.1", "h.2"), ("h.3", "ln_f", "lm_head"),
    ]  # fmt: skip

    model = TinyGPT(depth=4)
    aliases = alias_table(model)
    real = {aliases[n]: t for n, t in model.named_parameters()}
    last = pipe.get_stage_module(2)
    point_at(last, real, aliases)
    assert last.get_submodule("lm_head").weight is model.wte.weight  # found by its canonical name
    assert last.get_submodule("h.3.attn.qkv").weight is model.h[3].attn.qkv.weight
    assert not any(t.is_meta for t in _tensors(last))
    without_h1 = {k: v for k, v in real.items() if not k.startswith("h.1.")}
    with pytest.raises(RuntimeError, match=r"stage reads h\.1\.\S+, which this rank does not hold"):
        point_at(pipe.get_stage_module(1), without_h1, aliases)


def test_the_block_list_with_most_parameters_is_where_stages_begin():
    class TwoLists(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(1, 1) for _ in range(6))
            self.big = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    assert find_block_list(TwoLists()) == ("big", ["0", "1"])
    assert find_block_list(TinyGPT(depth=3)) == ("h", ["0", "1", "2"])

    class Numbered(nn.Module):  # torchtitan's layout: layers in a ModuleDict keyed by block numbers
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(3)})
            self.named = nn.ModuleDict({"a": nn.Linear(9, 9), "b": nn.Linear(9, 9)})  # not blocks

    assert find_block_list(Numbered()) == ("layers", ["0", "1", "2"])
    # A block that is only a container (x-transformers: norm, layer, residual) is entered at its first call.
    order = ["emb", "layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1", "head"]
    assert block_entry(order, "layers.1") == "layers.1.0" and block_entry(order, "head") == "head"
    with pytest.raises(ValueError, match=r"`layers.2` is never called by forward, nor anything inside it"):
        block_entry(order, "layers.2")
    with pytest.raises(
        ValueError, match=r"Linear has no nn\.ModuleList of blocks to split at: pass .*split_points"
    ):
        find_block_list(nn.Linear(2, 2))


def test_split_points_are_checked_against_the_module_and_the_call_order(gpt):
    model, _, _, order = gpt
    assert check_split_points(model, ["h.1", "h.3"], order, 3) == ["h.1", "h.3"]
    with pytest.raises(TypeError, match=r"split_points must be module paths \(str\), got 2"):
        check_split_points(model, [2], order, 2)
    with pytest.raises(ValueError, match=r"TinyGPT has no submodule 'h\.9'; the blocks are h\.0 \.\. h\.3"):
        check_split_points(model, ["h.9"], order, 2)
    with pytest.raises(
        ValueError, match=r"Linear has no submodule 'x'; the blocks are \(no nn\.ModuleList found\)"
    ):
        check_split_points(nn.Linear(2, 2), ["x"], [], 2)
    unused = TinyGPT(depth=4)
    unused.spare = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'spare' is never called by TinyGPT\.forward"):
        check_split_points(unused, ["spare"], order, 2)
    with pytest.raises(
        ValueError, match=r"names 1 stage beginnings \(\['h\.2'\]\), which make 2 stages, .*has 3"
    ):
        check_split_points(model, ["h.2"], order, 3)
    for points in (["h.3", "h.1"], ["h.1", "h.1"]):
        with pytest.raises(ValueError, match="must be distinct and in the order forward calls them"):
            check_split_points(model, points, order, 3)


def test_block_extras_count_the_parameters_before_and_after_the_blocks_once(gpt):
    _, twin, _, order = gpt
    vocab, dim, block_size = 13, 8, 8
    # Before: wte + wpe. After: ln_f; lm_head's weight is wte's, counted already.
    assert block_extras(twin, order, "h") == (vocab * dim + block_size * dim, 2 * dim)


def test_keep_only_drops_the_other_stages_and_keeps_the_keys(contents):
    model = TinyGPT(depth=4)
    before = model.state_dict(keep_vars=True)
    last = contents[1].tensors
    keep_only(model, set(last))
    after = model.state_dict(keep_vars=True)
    assert list(after) == [k for k in before if k in last]
    assert all(after[k] is before[k] for k in after)  # the real tensors, not copies
    assert list(model.h._modules) == ["2", "3"] and not hasattr(model, "wte") and hasattr(model, "lm_head")
    assert isinstance(model.h.get_submodule("2.mlp.1"), nn.GELU)  # no tensors, nothing to drop: it stays
    keep_only(model, set())
    assert list(model.state_dict()) == []


def test_a_single_stage_is_built_around_the_real_tensors():
    """torch's _PipelineStage asks the process group its rank: an in-process group of one (no spawn)."""
    model = TinyGPT(depth=2)
    twin = meta_twin(model)
    _one_process_group()
    stages = TracedStages(twin, [], [0], model, alias_table(model), torch.device("cpu"), None)
    pipe = trace(twin, to_meta((TOKENS,)), [], train=True)
    stages.keep_for_later(True, to_meta((TOKENS,)), pipe)
    [stage] = stages.build("train", 2, (TOKENS,))
    assert stages.traces == 1  # the pipe traced for planning is used, not traced again
    assert stage.stage_index == 0 and stage.num_stages == 1
    assert stage.submod.get_submodule("lm_head").weight is model.wte.weight
    torch.testing.assert_close(stage.submod(TOKENS), model(TOKENS))
    for shape in [(3, 5), (1, 7), (5, 2)]:  # other lengths and micro-batch sizes (1 too): one program
        tokens = torch.randint(0, 13, shape)
        [other] = stages.build("train", 1, (tokens,))
        assert other.submod is stage.submod
        torch.testing.assert_close(other.submod(tokens), model(tokens))
    assert stages.traces == 1
    stages.build("eval", 2, (TOKENS,))
    assert stages.traces == 2


def _one_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class LengthBranchGPT(TinyGPT):
    """A forward that branches on its sequence length: export keeps the length dynamic within a range."""

    def forward(self, idx):
        logits = super().forward(idx)
        return logits * 2 if idx.shape[1] > 4 else logits


def test_a_length_outside_the_traced_range_is_traced_again_with_one_warning():
    torch.manual_seed(0)
    model = LengthBranchGPT(depth=2)
    _one_process_group()
    warned = []
    stages = TracedStages(meta_twin(model), [], [0], model, alias_table(model), torch.device("cpu"), None,
                          warn=warned.append)  # fmt: skip
    for length, traces in [(8, 1), (6, 1), (3, 2), (2, 2), (7, 2), (4, 2)]:
        tokens = torch.randint(0, 13, (2, length))
        [stage] = stages.build("train", 1, (tokens,))
        assert stages.traces == traces, (length, stages.traces)
        torch.testing.assert_close(stage.submod(tokens), model(tokens))  # the branch of this length
    assert len(warned) == 1 and "input 0 dim 1: 3, outside the traced range [5, ...)" in warned[0], warned


def test_a_forward_that_cannot_be_exported_with_dynamic_sizes_falls_back_to_one_trace_per_shape(monkeypatch):
    export = torch.export.export

    def static_only(*args, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("Could not guard on data-dependent expression u0 (a stand-in)")
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", static_only)
    model = TinyGPT(depth=2)
    _one_process_group()
    warned = []
    stages = TracedStages(meta_twin(model), [], [0], model, alias_table(model), torch.device("cpu"), None,
                          warn=warned.append)  # fmt: skip
    for length in (5, 6, 5):
        tokens = torch.randint(0, 13, (2, length))
        [stage] = stages.build("train", 1, (tokens,))
        torch.testing.assert_close(stage.submod(tokens), model(tokens))
    assert stages.traces == 2  # one per shape; the second 5 is served by the first trace
    assert "could not be exported with dynamic sizes (RuntimeError: Could not guard" in warned[0], warned
    assert len(warned) == 2 and "6" in warned[1]  # and the retrace for the new shape says why


def _ops(pipe) -> set[str]:
    """Every op the pipe's stage graphs (and the graphs nested in them) call."""
    return {
        str(n.target)
        for i in range(pipe.num_stages)
        for gm in pipe.get_stage_module(i).modules()
        if hasattr(gm, "graph")
        for n in gm.graph.nodes
        if n.op == "call_function"
    }


def test_the_stages_are_traced_for_the_device_they_run_on():
    """DeviceAwareGPT enters ``torch.autocast(x.device.type, enabled=False)`` (which has no ``meta`` type)
    and picks its attention kernel with ``if x.device.type == "cuda"``: each trace takes its device's path."""
    twin = meta_twin(DeviceAwareGPT(depth=2))
    example = to_meta((TOKENS,))
    assert call_order(twin, example, device="cuda:0") == call_order(twin, example)  # (CPU by default)
    on_cpu = trace(twin, example, ["h.1"], train=True)
    assert "aten.masked_fill.Scalar" in _ops(on_cpu)
    assert "aten.scaled_dot_product_attention.default" not in _ops(on_cpu)
    assert on_cpu.dynamic_failure is None  # one program for every length, as before
    on_cuda = trace(twin, example, ["h.1"], train=True, device="cuda:0")
    assert "aten.scaled_dot_product_attention.default" in _ops(on_cuda)
    assert "aten.masked_fill.Scalar" not in _ops(on_cuda)
    # Without a CUDA build, SDPA's meta kernel cannot take symbolic sizes on fake CUDA tensors: the
    # static program is traced instead, on fresh inputs (the failed dynamic export marks its inputs).
    assert on_cuda.dynamic_failure is not None
    for pipe in (on_cpu, on_cuda):  # nothing real was allocated: the stages hold the twin's meta tensors
        assert all(t.is_meta for t in [*pipe.split_gm.parameters(), *pipe.split_gm.buffers()])
    assert all(t.is_meta for t in _tensors(twin))


def test_a_device_aware_stage_runs_as_the_model_on_the_cpu():
    torch.manual_seed(0)
    model = DeviceAwareGPT(depth=2)
    _one_process_group()
    stages = TracedStages(meta_twin(model), [], [0], model, alias_table(model), torch.device("cpu"), None)
    for shape in [(2, 8), (3, 5)]:
        tokens = torch.randint(0, 13, shape)
        [stage] = stages.build("train", 1, (tokens,))
        torch.testing.assert_close(stage.submod(tokens), model(tokens))
    assert stages.traces == 1


def test_the_twin_runs_its_own_modules_through_lambdas_and_bound_methods():
    """minGPT keeps ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))``: the twin's copy must call the
    twin's modules, or export lifts the user's real weights as constants that no gradient reaches."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
            m = self.lin
            self.mlpf = lambda x: m(x) * 2
            self.project = self.out.forward

        def forward(self, x):
            return self.project(self.mlpf(x))

    block = Block()
    twin = meta_twin(block)
    assert twin.mlpf is not block.mlpf and twin.mlpf.__closure__[0].cell_contents is twin.lin
    assert twin.project.__self__ is twin.out and block.project.__self__ is block.out
    pipe = trace(twin, to_meta((torch.ones(2, 4),)), [], train=True)
    assert stage_contents(pipe)[0].tensors == {"lin.weight", "lin.bias", "out.weight", "out.bias"}
