"""PipelineStrategy(sequence_parallel_size=k): each sequence split over k ranks, against one device.

One spawned job of 4 gloo ranks runs each configuration in turn (the imports paid once): a Sequential
GPT written with ``F.scaled_dot_product_attention`` at k=2 beside 2 replicas, a traced GPT at k=2 x 2
pipeline stages, and a Hugging Face Llama with grouped-query attention (4 query heads, 2 key/value heads)
at k=2 beside 2 replicas (its own ``labels=`` loss: counted from the call, and by the user's
``labelled_tokens(..., shift=True)``, tuple and dict batches); the first two predict too (each token's
logits, the shards' joined in token order). Every target carries ``-100`` prompt labels (the first shard
holds more of them than the second, so only a token-weighted mean is exact: ``TokenWeightedLoss``). A
GPT whose attention is a hand-written softmax is refused on every rank after its first step, naming what
was looked for, with one pipeline rank and with two (whose stages' attentions are counted together): that
check, the declared heads and the warning about ``labels=`` handed to a module holding a shifting model
are techniques/sequence_parallel/model_checks.py's.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections import UserDict

import hf_env
import pytest
import torch
from mp_harness import (
    GatheredRecorder,
    assert_close_dicts,
    fit,
    merged_records,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from tiny_models import SequentialGPT, TinyGPT, loader, token_data, with_sdpa
from torch import nn
from torch.utils.data import TensorDataset

from lightning_parallel import PipelineStrategy, TokenWeightedLoss, labelled_tokens
from lightning_parallel.pipeline.stage_source import UnsplitModel
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.techniques.sequence_parallel.model_checks import FoundAttention, declared_heads
from lightning_parallel.techniques.sequence_parallel.technique import TECHNIQUE

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

WORLD, GLOBAL_BATCH, PROMPT = 4, 8, 3
TRAIN = dict(max_epochs=2)  # 16 samples: 2 optimizer steps an epoch

# name -> (model, strategy kwargs); data-parallel replicas are what the 4 ranks leave.
CONFIGS = {
    "sequential-dp2-sp2": ("sequential", dict(pipeline_size=1, sequence_parallel_size=2)),
    "traced-pp2-sp2": ("traced", dict(pipeline_size=2, sequence_parallel_size=2)),
    "llama-gqa-dp2-sp2": ("llama", dict(pipeline_size=1, sequence_parallel_size=2)),
    # The model's own labels= loss, which shifts them: the labels made in the step (a tuple batch), and a
    # dict batch passed whole as keywords (self.model(**batch)); items counted from the call's labels.
    "llama-labels-pp2-sp2": ("llama-labels", dict(pipeline_size=2, sequence_parallel_size=2)),
    "llama-dict-dp2-sp2": ("llama-dict", dict(pipeline_size=1, sequence_parallel_size=2)),
    # The same loss with the user's count, labelled_tokens(..., shift=True): each shard counts its labels
    # shifted across the boundary (a dict batch: the shift_labels it gained; a tuple batch: gathered).
    "llama-count-dp2-sp2": ("llama-count", dict(pipeline_size=1, sequence_parallel_size=2)),
    "llama-dict-count-dp2-sp2": ("llama-dict-count", dict(pipeline_size=1, sequence_parallel_size=2)),
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return with_sdpa(SequentialGPT(depth=2))
    if kind == "traced":
        return with_sdpa(TinyGPT(depth=2))
    if kind == "softmax":
        return TinyGPT(depth=2)  # (its attention: softmax(q @ k^T), no SDPA)
    from hf_models import HFCausalLM  # (skips where transformers is missing, outside CI)

    # 2 blocks: one a stage at pp 2 (the export and the cut into stages cost per block traced)
    if kind.startswith("llama-"):
        return _own_labels(HFCausalLM)("llama", call="labels", lr=1e-3, layers=2)
    return HFCausalLM("llama", call="logits", lr=1e-3, layers=2)


def _own_labels(base: type) -> type:
    class OwnLabels(base):
        """The Hugging Face model's own loss: ``labels=`` (the prompt's and every third sample's last
        position ``-100``), which the model shifts itself."""

        def _loss(self, batch):
            if isinstance(batch, dict):
                return self.model(**batch).loss
            if len(batch) == 2:  # (x, labels)
                return self.model(input_ids=batch[0], labels=batch[1]).loss
            x, _, unlabelled = batch  # (per token, so each shard holds its own: not by position)
            return self.model(input_ids=x, labels=x.masked_fill(unlabelled.bool(), -100)).loss

    return OwnLabels


def _prompt_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    labels[::3, -1] = -100
    return labels


def _data(kind: str) -> TensorDataset:
    """16 samples whose first ``PROMPT`` targets are ``-100`` (a prompt), and one more in every third."""
    if kind in ("llama-dict", "llama-dict-count"):
        from hf_models import hf_token_data

        x = hf_token_data(16, t=8).tensors[0]
        return [{"input_ids": i, "labels": label} for i, label in zip(x, _prompt_labels(x))]
    if kind == "llama-count":
        from hf_models import hf_token_data

        x = hf_token_data(16, t=8).tensors[0]
        return TensorDataset(x, _prompt_labels(x))
    if kind == "llama-labels":
        from hf_models import hf_token_data

        x = hf_token_data(16, t=8).tensors[0]
        return TensorDataset(x, x, (_prompt_labels(x) == -100).long())
    if kind.startswith("llama"):
        from hf_models import hf_token_data

        x, y, mask = hf_token_data(16, t=8).tensors
    else:
        x, y = token_data(16, t=8).tensors
    y = y.clone()
    y[:, :PROMPT] = -100
    y[::3, -1] = -100
    return TensorDataset(x, y, mask) if kind.startswith("llama") else TensorDataset(x, y)


def _callbacks(kind: str) -> list:
    """The loss computed from the logits: a token-weighted mean; the model's own: counted from its call,
    or by the user's count of the labels the model shifts."""
    if kind.endswith("-count"):
        return [TokenWeightedLoss(labelled_tokens("labels" if "dict" in kind else 1, shift=True))]
    return [] if kind.startswith("llama-") else [TokenWeightedLoss(labelled_tokens(1))]


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    predicted: dict[str, list] = {}
    for name, (kind, kwargs) in CONFIGS.items():
        dp = world // (kwargs["pipeline_size"] * kwargs["sequence_parallel_size"])
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(num_microbatches=2, **kwargs),
            callbacks=[*_callbacks(kind), GatheredRecorder(f"{out_dir}/{name}-rank{rank}.pt")], **TRAIN,
        )  # fmt: skip
        model = _model(kind)
        trainer.fit(model, loader(_data(kind), GLOBAL_BATCH // dp))
        if not kind.startswith("llama"):  # each token's predictions, the shards' joined (rank 0 has them)
            model.predict_step = lambda batch, batch_idx, model=model: model(batch[0])
            predicted[name] = trainer.predict(model, loader(_data(kind), GLOBAL_BATCH // dp))
    refused = {}
    for pipeline_size in (1, 2):  # (with stages, the attentions are counted over the pipeline)
        refused[pipeline_size] = ""
        try:
            strategy = PipelineStrategy(pipeline_size=pipeline_size, sequence_parallel_size=2)
            trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
            trainer.fit(_model("softmax"), loader(_data("softmax"), GLOBAL_BATCH))
        except RuntimeError as err:
            refused[pipeline_size] = str(err)
    torch.save({"refused": refused, "predicted": predicted}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
def test_sequence_parallel_training_matches_one_device(tmp_path):
    hf_env.require("transformers")
    refs = {
        kind: fit(_model(kind), reference_loader(_data(kind), GLOBAL_BATCH), tmp_path / f"ref-{kind}",
                  callbacks=_callbacks(kind), **TRAIN)[0]
        for kind, _ in CONFIGS.values()
    }  # fmt: skip
    records = spawn_gloo(_job, WORLD, tmp_path)
    for name, (kind, _) in CONFIGS.items():
        params, losses, _ = merged_records(tmp_path, name, WORLD)
        try:
            assert_close_dicts(params, refs[kind]["params"], rtol=1e-5, atol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
        assert len(losses) == len(refs[kind]["losses"]) == 4
        if not kind.startswith("llama"):  # every token's logits of every sample, in order, on rank 0
            model = _model(kind)
            model.load_state_dict(refs[kind]["params"])
            with torch.no_grad():
                want = model.eval()(_data(kind).tensors[0])
            got = torch.cat(records[0]["predicted"][name])
            assert got.shape == want.shape == (16, 8, 13)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Every rank refused the GPT without SDPA, with what was looked for and the fix.
    for record in records:
        for refused in record["refused"].values():  # (one pipeline rank; two)
            assert "found no attention to split in TinyGPT" in refused
            assert "scaled_dot_product_attention" in refused and "attn_implementation='sdpa'" in refused


# ------------------------------------------------------------------------------ refusals, one process
class _Heads(nn.Module):
    def __init__(self, heads: int, kv: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv
        self.proj = nn.Linear(4, 4)


def test_a_head_count_k_does_not_divide_is_refused_at_setup_naming_the_sizes_that_work():
    plan = ParallelPlan(sequence_parallel_size=4)
    gqa = nn.Sequential(_Heads(8, 2))
    assert declared_heads(gqa) == {"_Heads at '0'": (8, 2)}
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4 .* 8 query heads and 2 key/value heads.*"
                       r"the sizes that work are 1, 2 \(_Heads at '0'\)"):  # fmt: skip
        TECHNIQUE.before_split(plan, UnsplitModel(gqa, gqa))
    TECHNIQUE.before_split(ParallelPlan(sequence_parallel_size=2), UnsplitModel(gqa, gqa))
    gpt = with_sdpa(TinyGPT(depth=1, heads=2))
    with pytest.raises(ValueError, match=r"2 heads: 4 must divide them; the sizes that work are 1, 2"):
        TECHNIQUE.before_split(plan, UnsplitModel(gpt, gpt))


class _Mesh:
    def rank(self, role: str) -> int:
        assert role == "sequence"
        return 1


def test_each_batch_becomes_this_ranks_shard_and_a_length_k_does_not_divide_names_pad_to_multiple():
    shard = TECHNIQUE.batch(ParallelPlan(sequence_parallel_size=2), _Mesh(), TinyGPT(depth=1))
    x, y = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 1
    sx, sy = shard((x, y))
    assert sx.tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]] and sy.tolist() == [[5, 6, 7, 8], [13, 14, 15, 16]]
    with pytest.raises(ValueError, match=r"sequences are 7 tokens long.*pad_to_multiple"):
        shard((x[:, :7], y[:, :7]))
    assert TECHNIQUE.batch(ParallelPlan(), _Mesh(), TinyGPT(depth=1)) is None


class _ShiftingLM(nn.Module):
    """Stands for a Hugging Face causal LM: its loss shifts labels= (transformers' loss_type)."""

    loss_type = "ForCausalLM"

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyGPT(depth=1)


def test_labels_a_hugging_face_loss_shifts_itself_are_shifted_before_the_split():
    shard = TECHNIQUE.batch(ParallelPlan(sequence_parallel_size=2), _Mesh(), _ShiftingLM())
    ids = torch.arange(16).view(2, 8)
    for batch in ({"input_ids": ids, "labels": ids}, UserDict({"input_ids": ids, "labels": ids})):
        out = shard(batch)  # (a tokenizer's BatchEncoding is a UserDict: it stays one)
        assert type(out) is type(batch) and "shift_labels" not in batch  # (the user's batch unchanged)
        # Shard 1 of 2: its last position's label is the sequence's end (-100), the others the next token.
        assert out["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]
        assert out["labels"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    given = torch.full((2, 8), 3)  # (shift_labels the batch carries: sharded as they are)
    out = shard({"input_ids": ids, "labels": ids, "shift_labels": given})
    assert out["shift_labels"].tolist() == [[3] * 4] * 2
    # A model that does not shift its labels: a dict batch's labels are sharded as they are, no more.
    plain = TECHNIQUE.batch(ParallelPlan(sequence_parallel_size=2), _Mesh(), TinyGPT(depth=1))
    out = plain({"input_ids": ids, "labels": ids})
    assert out["labels"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]] and "shift_labels" not in out


def test_labels_passed_to_a_shifting_call_get_the_next_shards_first_label_and_others_are_left_alone(
    monkeypatch,
):
    class _Group(_Mesh):
        def group(self, role: str) -> str:
            return f"{role}-group"

    holder = nn.Module()
    holder.model = _ShiftingLM()
    plan = ParallelPlan(sequence_parallel_size=2)
    keywords = TECHNIQUE.call_keywords(plan, _Group(), holder)
    gathered = []

    def shift_across_shards(labels, group, ignore_index):  # (the all-gather's part: tested with ranks)
        gathered.append((group, ignore_index))
        return labels + 1

    technique = importlib.import_module(TECHNIQUE.__module__)
    monkeypatch.setattr(technique, "shift_across_shards", shift_across_shards)
    labels = torch.arange(8).view(2, 4)
    out = keywords("model", {"input_ids": labels, "labels": labels})
    assert out["shift_labels"].tolist() == (labels + 1).tolist() and gathered == [("sequence-group", -100)]
    given = {"labels": labels, "shift_labels": labels}
    assert keywords("model", given) is given  # (shifted already)
    # labels= to the holder of a shifting model: left alone (it may shift them itself), said once.
    with pytest.warns(UserWarning, match=r"labels= is passed to the model, .*model \(_ShiftingLM\)"):
        assert "shift_labels" not in keywords("", {"labels": labels})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "shift_labels" not in keywords("", {"labels": labels})  # (once)
    assert keywords("model", {"input_ids": labels}) == {"input_ids": labels}  # (no labels)
    assert TECHNIQUE.call_keywords(ParallelPlan(), _Group(), holder) is None
    assert TECHNIQUE.call_keywords(plan, _Group(), TinyGPT(depth=1)) is None


def test_the_plan_refuses_what_cannot_split_the_sequence_and_sizes_the_grid():
    plan = ParallelPlan(pipeline_size=2, sequence_parallel_size=2).for_devices(8)
    assert plan.data_parallel_size == 2 and plan.label() == "pp 2x2 1f1b m=4 +sp 2"
    assert plan.layout().mesh_shape == (2, 2, 1, 2, 1)
    assert plan.code() == "PipelineStrategy(pipeline_size=2, sequence_parallel_size=2)"
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int"):
        ParallelPlan(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: both split the attention heads"):
        ParallelPlan(sequence_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="compile"):
        ParallelPlan(sequence_parallel_size=2, compile=True)
    with pytest.raises(
        ValueError, match=r"pipeline_size x sequence_parallel_size \(2 x 2 = 4\) does not divide"
    ):
        ParallelPlan(pipeline_size=2, sequence_parallel_size=2).for_devices(6)


def test_no_attention_found_is_refused_after_the_first_step_naming_what_was_looked_for():
    found = FoundAttention(1, "MyModel", torch.device("cpu"))
    found.counts.append(lambda: 0)
    with pytest.raises(RuntimeError, match=r"no attention to split in MyModel.*scaled_dot_product"), found:
        pass
    with found:  # (checked once)
        pass


def test_the_shards_predictions_join_in_token_order_and_a_value_without_tokens_that_differs_is_refused():
    from lightning_parallel.techniques.sequence_parallel.shards import joined_shards

    first = {"ids": torch.tensor([[0, 1]]), "n": 3, "per_sample": torch.tensor([1.0])}
    second = {"ids": torch.tensor([[2, 3]]), "n": 3, "per_sample": torch.tensor([1.0])}
    joined = joined_shards([first, second], length=2)
    assert (
        joined["ids"].tolist() == [[0, 1, 2, 3]]
        and joined["n"] == 3
        and joined["per_sample"].tolist() == [1.0]
    )
    second["per_sample"] = torch.tensor([2.0])
    with pytest.raises(ValueError, match=r"output\['per_sample'\] differs between the 2 shards.*per-token"):
        joined_shards([first, second], length=2)
