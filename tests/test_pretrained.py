"""load_pretrained: safetensors weights read per stage into a model built on the meta device (no spawns).

Covers sources/pretrained.py.
"""

import pytest
import torch
from hf_models import hf_config, hf_model
from transformers import AutoModelForCausalLM

from lightning_parallel import load_pretrained
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.traced.split import keep_only
from lightning_parallel.sources.twin import alias_table


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = hf_model("llama", tied=True)
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return model, directory


def test_a_meta_model_reads_only_its_stage_and_gets_the_buffers_right(saved):
    model, directory = saved
    with torch.device("meta"):
        stage = AutoModelForCausalLM.from_config(hf_config("llama", tied=True))
    aliases = alias_table(stage)
    assert load_pretrained(stage, directory) == []  # on the meta device: loaded at materialisation
    # The last stage of two: blocks 2-3, the final norm and the head (tied to the embedding, which the
    # files hold once, under the embedding's name); the rotary table is a buffer no file holds.
    last = ("model.layers.2.", "model.layers.3.", "model.norm")
    keep = {k for k in stage.state_dict() if k.startswith(last)}
    keep |= {"lm_head.weight", "model.rotary_emb.inv_freq"}  # what the stage graph reads
    keep_only(stage, keep)
    materialize(stage, torch.device("cpu"), aliases)

    expected = model.state_dict()
    got = stage.state_dict()
    assert set(got) == {k for k in keep if k in expected}
    for name, buffer in model.named_buffers():  # computed in __init__, saved in no file
        torch.testing.assert_close(stage.get_buffer(name), buffer, rtol=0, atol=0, msg=name)
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(stage.lm_head.weight, model.model.embed_tokens.weight, rtol=0, atol=0)


def test_a_real_model_loads_at_once_and_missing_weights_are_named(saved, tmp_path):
    model, directory = saved
    torch.manual_seed(1)
    other = hf_model("llama", tied=True)
    assert "model.norm.weight" in load_pretrained(other, directory)
    for key, value in other.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=0, msg=key)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        load_pretrained(other, tmp_path)
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias is in none"):
        load_pretrained(hf_model("qwen2"), directory)
