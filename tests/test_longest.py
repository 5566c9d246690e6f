"""The sequence-length axis (planner/longest.py, ``--longest`` / ``--lengths``): the longest sequence that
fits per sequence-parallel size grows with ``k`` as the memory model says, no length a ``k`` cannot split
is reported, and the command names the axis. One process, a tiny SDPA GPT measured at 64, 128 and 256
tokens once (a second or two), its plans sized at every length from that."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import TinyGPT, with_sdpa

from lightning_parallel.planner.__main__ import main
from lightning_parallel.planner.lengths import measure_lengths
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.longest import candidates_at, longest_lengths, specs_at
from lightning_parallel.planner.ranking import Budget, fastest_fit
from lightning_parallel.planner.search import Search

UPPER = 32768
LINKS = given_links(10e9, 1e-5)


class _Unpositioned(TinyGPT):
    """TinyGPT without its position table (which would grow with the upper length and hold most of the
    state): what every rank holds whatever the length is then small, and the activations dominate."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return with_sdpa(_Unpositioned(vocab=13, dim=16, depth=4, heads=4, block_size=1))


def _batch(tokens: int, samples: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(samples, tokens, dtype=torch.long)
    return x, x


# Two devices, two samples a step: k = 1 is two replicas of one sample (or a 2-stage pipeline), k = 2 one
# group holding both samples, each rank half of every sample's tokens; no offload (the host would hold it).
SEARCH = Search(devices=2, global_batch_size=2, offload=False, sequence_parallel=True)


@pytest.fixture(scope="module")
def scaled():
    model = _gpt()
    return measure_lengths(model, _batch, SEARCH, upper=256, optimizer=torch.optim.AdamW(model.parameters()))


def test_the_longest_length_nearly_doubles_from_k_1_to_2_where_activations_dominate(scaled):
    budget = Budget(8 * 2**20, margin=0.0)
    table = longest_lengths(scaled, SEARCH, budget, LINKS, upper=UPPER)
    longest = {f.k: f for f in table.longest}
    assert set(longest) == {1, 2} and table.multiple == 2
    one, two = longest[1].tokens, longest[2].tokens
    assert 0 < one < two < UPPER and not table.bounded
    # Each rank of k = 2 keeps half of every per-token byte, plus the exchange's send and receive buffers
    # (1/14 of it here): 1.86x, as bench_long_context measured 1.92x where the activations fill the budget.
    assert 1.8 < two / one <= 2.0, (one, two)
    for f in table.longest:  # the bisection's answer: a plan of k fits there, none a multiple further
        assert f.best is not None and f.best.plan.sequence_parallel_size == f.k
        assert fastest_fit(candidates_at(scaled, f.tokens, SEARCH, LINKS, f.k), budget) is not None
        assert fastest_fit(candidates_at(scaled, f.tokens + 2, SEARCH, LINKS, f.k), budget) is None
    assert table.best() is longest[2]
    assert longest[1].tokens_per_second > 0


def test_no_length_a_k_cannot_split_is_reported(scaled):
    budget = Budget(12 * 2**20, margin=0.0)
    table = longest_lengths(scaled, SEARCH, budget, LINKS, upper=5000, multiple=3)
    assert table.multiple == 6 and table.upper == 4998
    for f in table.rows + table.longest:
        assert f.tokens % 6 == 0 and (f.best is None or f.tokens % f.best.plan.sequence_parallel_size == 0)
    odd = longest_lengths(scaled, SEARCH, budget, LINKS, lengths=[999, 1000])
    at_999 = next(f for f in odd.rows if f.tokens == 999)
    assert at_999.best is not None and at_999.best.plan.sequence_parallel_size == 1  # (2 does not split 999)
    assert {f.k: f.tokens for f in odd.longest} == {1: 1000, 2: 1000}


def test_specs_at_replaces_the_sequence_dimension():
    specs = ["long:64", "long:64", "float32:3,32"]
    assert specs_at(specs, 16) == (["long:16", "long:16", "float32:3,32"], 64)
    with pytest.raises(ValueError, match="need --batch with a sequence length"):
        specs_at(["float32:"], 16)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "gpt.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from tiny_models import TinyGPT, with_sdpa\n\n"
        "def gpt():\n    return with_sdpa(TinyGPT(vocab=13, dim=16, depth=4, heads=4, block_size=2048))\n"
    )
    return f"{path}:gpt"


def test_the_command_prints_the_length_axis_and_the_longest_per_k(model_file, capsys):
    argv = [model_file, "--batch", "long:2048", "long:2048", "--global-batch-size", "2", "--devices", "2",
            "--memory", "6MiB", "--no-offload", "--bandwidth", "10GB/s"]  # fmt: skip
    assert main([*argv, "--longest"]) == 0
    out = capsys.readouterr().out
    assert "sequence length" in out and "longest sequence per sequence-parallel size (sp)" in out
    assert "measured at 128, 256, 512 tokens" in out and "sequence_parallel_size=2" in out
    assert main([*argv, "--lengths", "512,1024"]) == 0
    out = capsys.readouterr().out
    assert "of the lengths asked (512, 1024)" in out
    assert main([*argv, "--lengths", "4096"]) == 2
    assert "give --batch at least that long" in capsys.readouterr().err
