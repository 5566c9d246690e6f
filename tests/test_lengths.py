"""The planner's facts at any sequence length (planner/lengths.py): bytes fitted from three short lengths
equal a direct measurement at a long one; times grow linearly per token, faster where a unit attends.
One process, a tiny GPT measured at 64, 128 and 256 tokens (a second or two)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyGPT, with_sdpa

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.lengths import measure_lengths, probe_lengths
from lightning_parallel.planner.search import Search

LONG = 640  # (not a power of two; 2.5x the longest measured)


def _gpt(sdpa: bool) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=13, dim=16, depth=2, heads=4, block_size=LONG)
    return with_sdpa(model) if sdpa else model


def _batch(tokens: int, samples: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(samples, tokens, dtype=torch.long)
    return x, x


def test_probe_lengths_are_a_reference_its_half_and_quarter_in_multiples():
    assert probe_lengths(32768, 4) == (128, 256, 512)
    assert probe_lengths(256, 8) == (64, 128, 256)
    assert probe_lengths(12, 4) == (4, 12)  # (12 // 4 and 12 // 2 round to 4: two lengths, a line)
    assert all(t % 12 == 0 for t in probe_lengths(1000, 12))


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa: linear in t", "eager: (b, h, t, t) kept"])
def test_bytes_at_a_long_length_equal_a_direct_measurement(sdpa):
    model = _gpt(sdpa)
    search = Search(devices=2, global_batch_size=4)
    adamw = torch.optim.AdamW(model.parameters())
    scaled = measure_lengths(model, _batch, search, upper=256, optimizer=adamw)
    assert scaled.lengths == (64, 128, 256)
    direct = measure_model(model, _batch(LONG), optimizer=torch.optim.AdamW(model.parameters()))
    at = scaled.at(LONG)[1]
    assert at.tokens == LONG
    for plan in (
        ParallelPlan("pipeline", 2, 1, num_microbatches=2),
        ParallelPlan("pipeline", 2, 2, num_microbatches=4, activation_checkpointing=True),
        ParallelPlan("pipeline", 2, 1, num_microbatches=2, sequence_parallel_size=2),
    ):
        got, want = predict(at, plan, samples=4), predict(direct, plan, samples=4)
        assert [r.peak for r in got.ranks] == pytest.approx([r.peak for r in want.ranks], rel=1e-6)


def test_time_per_sample_grows_with_the_length_and_faster_where_a_unit_attends():
    model = _gpt(sdpa=True)
    search = Search(devices=2, global_batch_size=4)
    adamw = torch.optim.AdamW(model.parameters())
    scaled = measure_lengths(model, _batch, search, upper=256, optimizer=adamw)
    base, long = scaled.facts[1].times, scaled.at(4 * 256)[1].times
    assert base is not None and long is not None
    for name, unit in base.units.items():
        scaled_unit = long.units[name]
        assert scaled_unit.forward.intercept == unit.forward.intercept  # (a call's cost, whatever its size)
        ratio = scaled_unit.forward.slope / unit.forward.slope if unit.forward.slope else 4.0
        if name.startswith("h.") and not name.endswith(">"):
            assert ratio > 4.0  # the attention's share grows with t: more than the tokens' 4x
        else:
            assert ratio == pytest.approx(4.0)
