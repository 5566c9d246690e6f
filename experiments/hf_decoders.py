"""Hugging Face decoders (from a config, no download) as the benchmarks and the memory validation train them.

A LightningModule that holds ``self.model`` (a ``transformers`` causal LM) and calls
``self.model(input_ids=x).logits`` in its step, as a fine-tuning script does; PipelineStrategy
pipelines that call. Byte-level vocabulary (256) so the experiments' byte data feeds it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

# `make test` installs transformers into .hf_packages, off the venv (see the Makefile); appended after
# Lightning's import, so torchmetrics does not import it in every process.
HF_PACKAGES = Path(__file__).resolve().parents[1] / ".hf_packages"
if HF_PACKAGES.is_dir() and str(HF_PACKAGES) not in sys.path:
    sys.path.append(str(HF_PACKAGES))

FAMILIES = ("llama", "gpt2")


def decoder_config(family: str, dim: int, depth: int, seq_len: int, heads: int = 4) -> Any:
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=4 * dim,
                              num_hidden_layers=depth, num_attention_heads=heads,
                              num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq_len,
                              tie_word_embeddings=True)  # fmt: skip
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=256, n_embd=dim, n_layer=depth, n_head=heads, n_positions=seq_len,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                             eos_token_id=0)  # fmt: skip
    raise ValueError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")


class HFDecoderLM(L.LightningModule):
    """Next-byte prediction with a Hugging Face decoder; the step calls ``self.model(input_ids=x)``.

    Example::

        model = HFDecoderLM("llama", dim=128, depth=8, seq_len=64)
        trainer.fit(model, StdlibText(64, 16, 2_000_000))
    """

    def __init__(self, family: str = "llama", dim: int = 128, depth: int = 8, seq_len: int = 64,
                 lr: float = 1e-3) -> None:  # fmt: skip
        super().__init__()
        import transformers as tf

        self.save_hyperparameters()
        self.model = tf.AutoModelForCausalLM.from_config(decoder_config(family, dim, depth, seq_len))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
