"""sources/symbolic_sizes.py and stage_shapes.py: one program with dynamic sizes, cut into stages.

One process, no process group: the traced pipe's stage graphs are run directly.
"""

import pytest
import torch
from tiny_models import TinyGPT
from torch.distributed.pipelining._IR import _modify_graph_op_device

from lightning_parallel.sources.stage_shapes import StageShapes, stage_examples
from lightning_parallel.sources.symbolic_sizes import (
    evaluate_shape,
    evaluate_stride,
    is_symbolic,
    symbol_values,
)
from lightning_parallel.sources.traced.stage_graphs import point_at
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch
SPLITS = ["h.1", "h.3"]


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = TinyGPT(depth=4, block_size=32)
    example = to_meta((torch.zeros(4, 16, dtype=torch.long),))
    return model, example, trace(meta_twin(model), example, SPLITS, train=True)


def _placeholder_values(stage_module):
    return [n.meta["val"] for n in stage_module.graph.nodes if n.op == "placeholder"]


def test_every_stage_computes_its_sizes_and_receives_only_tensors(traced):
    _, _, pipe = traced
    assert pipe.dynamic_failure is None
    roots = _placeholder_values(pipe.get_stage_module(0))
    assert [is_symbolic(s) for s in roots[0].shape] == [True, True]  # batch and length: one program
    for index in range(1, pipe.num_stages):  # a size handed on would be a P2P "tensor" torch cannot send
        values = _placeholder_values(pipe.get_stage_module(index))
        assert values and all(torch.is_tensor(v) for v in values), values


def test_the_one_program_runs_every_shape_exactly(traced):
    model, example, _ = traced
    pipe = trace(meta_twin(model), example, SPLITS, train=True)  # (its own: pointed at real tensors here)
    aliases = alias_table(model)
    real = {aliases.get(n, n): t for n, t in [*model.named_parameters(remove_duplicate=False)]}
    for index in range(pipe.num_stages):
        point_at(pipe.get_stage_module(index), real, aliases)
        _modify_graph_op_device(pipe.get_stage_module(index), torch.device("cpu"))
    for shape in [(4, 16), (3, 7), (1, 31), (6, 2)]:
        tokens = torch.randint(0, 13, shape)
        out: tuple = (tokens,)
        for index in range(pipe.num_stages):
            result = pipe.get_stage_module(index)(*out)
            out = result if isinstance(result, tuple) else (result,)
        torch.testing.assert_close(out[0], model(tokens), rtol=0, atol=0)


def test_stage_shapes_are_evaluated_as_a_fake_run_would_give_them(traced):
    _, example, pipe = traced
    shapes = StageShapes(pipe, example, train=True)
    assert shapes.symbolic and shapes.dynamic_dims == [[0, 1]]
    for shape in [(2, 9), (5, 30), (1, 3)]:  # a micro-batch of one sample too (a short last batch)
        new = to_meta((torch.zeros(shape, dtype=torch.long),))
        assert shapes.serves(new)
        fake = stage_examples(pipe, new, train=True)
        for (ins, outs), (fake_in, fake_out) in zip(shapes.examples(new), fake):
            for mine, theirs in zip((*ins, *outs), (*fake_in, *fake_out)):
                assert (mine.shape, mine.stride(), mine.dtype) == (
                    theirs.shape,
                    theirs.stride(),
                    theirs.dtype,
                )
                assert mine.requires_grad == theirs.requires_grad and mine.is_meta
    assert not shapes.serves(to_meta((torch.zeros(2, 3, 4, dtype=torch.long),)))  # another rank of input


def test_symbol_values_refuse_a_static_size_that_differs():
    s = torch.empty(2, 3).shape  # static sizes only: no symbol to bind
    assert symbol_values([s], [(2, 3)]) == {}
    with pytest.raises(ValueError, match="traced as the constant 3"):
        symbol_values([s], [(2, 4)])
    assert evaluate_shape((2, 5), {}) == (2, 5)


def test_a_sliced_input_of_one_sample_gets_the_contiguous_stride_where_its_traced_one_is_free():
    """A sequence shard of a one-sample batch is a slice: export traces its batch stride as a symbol of
    its own (the whole length), which no input size gives. A size-1 dimension is never stepped over, so
    the stride is the contiguous one; on a dimension of another size it is still refused."""
    from torch.export import Dim, export

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    shard = torch.zeros(1, 16)[:, 8:]  # (sequence parallelism's shard 1 of 2 of one sample)
    program = export(Twice(), (shard,), dynamic_shapes=({1: Dim.AUTO},), strict=False)
    traced = next(n.meta["val"] for n in program.graph.nodes if n.op == "placeholder")
    values = symbol_values([traced.shape], [(1, 12)])
    with pytest.raises(ValueError, match="depends on a value not among the inputs' sizes"):
        evaluate_shape(traced.stride(), values)  # (what failed the first step before)
    assert evaluate_stride((1, 12), traced.stride(), values) == (12, 1)
    with pytest.raises(ValueError, match="depends on a value"):
        evaluate_stride((2, 12), traced.stride(), values)
