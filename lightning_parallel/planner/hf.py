"""A Hugging Face causal LM from its ``config.json``, for the planner's command line (no weights read).

    python -m lightning_parallel.planner lightning_parallel.planner.hf:causal_lm \\
        --init config=llama-checkpoint/config.json --batch long:512 long:512 --meta \\
        --global-batch-size 64 --devices 8 --memory 80GiB --optimizer AdamW

The step is what a fine-tuning script runs: ``self.model(input_ids=x).logits`` and next-token
cross-entropy against the second tensor of the batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class CausalLMStep(torch.nn.Module):
    """``self.model`` (a ``transformers`` causal LM) trained on ``(input_ids, targets)``: the planner runs
    its ``training_step`` (a plain module: the planner imports no Lightning).

    Example::

        model = CausalLMStep(AutoModelForCausalLM.from_config(config))
        estimate_memory(model, (ids, targets), devices=4, strategy=PipelineStrategy(pipeline_size=2))
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def causal_lm(config: str, **overrides: Any) -> CausalLMStep:
    """The causal LM of a ``config.json`` (a file or the directory holding it); ``overrides`` change
    fields of the config (``num_hidden_layers=4``). Builds on the current default device (``--meta``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config, **overrides)
    return CausalLMStep(AutoModelForCausalLM.from_config(cfg))
