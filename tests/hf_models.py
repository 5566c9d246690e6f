"""Hugging Face decoders built from a config (no download), wrapped in LightningModules as users write them.

Every family the pipeline is tested on, at a tiny size: 4 blocks (``layers``), width 32, vocabulary 64.
Dropout is off (the one-device comparison needs the same numbers), and every ``*_init_range`` is left as
is.
"""

from __future__ import annotations

from typing import Any

import hf_env
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

hf_env.require("transformers")  # .hf_packages is on the path now; a test module importing this skips or fails

VOCAB = 64


def hf_config(family: str, tied: bool | None = None, layers: int = 4):
    """A tiny config of ``family``: gpt2, llama, qwen2, mistral, gemma or neox, of ``layers`` blocks."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4)  # fmt: skip
    if family == "gpt2":
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                            bos_token_id=0, eos_token_id=0, **no_dropout)  # fmt: skip
    elif family == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=bool(tied))
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=bool(tied))
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, num_key_value_heads=2, tie_word_embeddings=bool(tied))
    elif family == "gemma":
        cfg = tf.GemmaConfig(**common, num_key_value_heads=2, head_dim=8)
    elif family == "neox":
        cfg = tf.GPTNeoXConfig(**common, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    else:
        raise ValueError(family)
    if tied is not None and family in ("gpt2", "gemma"):
        cfg.tie_word_embeddings = tied
    return cfg


def hf_model(family: str, tied: bool | None = None, layers: int = 4):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_config(hf_config(family, tied, layers))


class HFCausalLM(L.LightningModule):
    """A Hugging Face decoder fine-tuned the usual way; ``call`` picks how the steps call it.

    * ``"forward"``: ``self(idx)``, whose ``forward`` returns ``self.model(input_ids=idx).logits``;
    * ``"logits"``: ``self.model(input_ids=x).logits`` in the step;
    * ``"masked"``: ``self.model(input_ids=x, attention_mask=mask).logits`` (a padded batch);
    * ``"labels"``: ``self.model(input_ids=x, labels=x).loss`` (the loss computed inside the model).
    """

    def __init__(
        self,
        family: str = "llama",
        tied: bool | None = None,
        call: str = "forward",
        lr: float = 1e-2,
        build: bool = True,
        layers: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = hf_model(family, tied, layers) if build else None
        self.call, self.lr = call, lr

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y, mask = batch
        if self.call == "forward":
            logits = self(x)
        elif self.call == "logits":
            logits = self.model(input_ids=x).logits
        elif self.call == "masked":
            logits = self.model(input_ids=x, attention_mask=mask).logits
        else:  # the model shifts the labels itself and returns the mean token loss
            return self.model(input_ids=x, labels=x).loss
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def hf_token_data(n: int = 16, t: int = 12, seed: int = 0, padded: bool = False) -> TensorDataset:
    """(input ids, next-token targets, attention mask); ``padded``: left padding of 0..3 tokens per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, t + 1), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    if padded:
        for i in range(n):
            mask[i, : i % 4] = 0
    return TensorDataset(x[:, :-1], x[:, 1:], mask)


class PretrainedCausalLM(HFCausalLM):
    """Fine-tunes weights saved with ``save_pretrained``: built in ``configure_model`` (on the meta device
    under PipelineStrategy, so each rank reads only its stage's tensors from the files)."""

    def __init__(
        self,
        family: str = "llama",
        tied: bool | None = True,
        weights: str = "",
        lr: float = 1e-3,
        layers: int = 4,
        **_: Any,
    ) -> None:  # (**_: the base class's hyperparameters, saved beside these in checkpoints)
        super().__init__(family, tied, "logits", lr, build=False, layers=layers)
        self.family, self.tied, self.weights, self.layers = family, tied, weights, layers

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import transformers as tf

        from lightning_parallel import load_pretrained

        self.model = tf.AutoModelForCausalLM.from_config(hf_config(self.family, self.tied, self.layers))
        load_pretrained(self.model, self.weights)


class LitGPTLM(HFCausalLM):
    """litgpt's ``GPT`` from a named ``Config`` (tiny), called as ``self.model(idx)`` in the step."""

    def __init__(self, name: str = "pythia-14m", lr: float = 1e-3, layers: int = 4) -> None:
        super().__init__("litgpt", None, "litgpt", lr, build=False)
        from litgpt.config import Config
        from litgpt.model import GPT

        size = dict(n_layer=layers, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64)
        config = Config.from_name(name, **size, padded_vocab_size=VOCAB, vocab_size=VOCAB, block_size=32)
        self.model, self.call, self.lr = GPT(config), "litgpt", lr

    def _loss(self, batch) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        # SGD: a parameter's difference from one device is lr x its gradient's, so the comparison sees
        # the gradients themselves; AdamW turns rounding noise in near-zero gradients (litgpt's fused
        # key bias, whose true gradient is zero) into steps of up to lr.
        return torch.optim.SGD(self.parameters(), lr=0.1)
