"""Fine-tuning as users bring it: samples of many lengths padded per batch, prompts labelled -100, LoRA.

A batch is ``{"input_ids", "attention_mask", "labels"}`` padded on the right to its longest sample
(pads: id 0, mask 0, label -100); the first tokens of every sample (its prompt) are labelled -100 too.
"""

from __future__ import annotations

from typing import Any

import hf_env
import lightning as L
import torch
import torch.nn.functional as F
from hf_models import VOCAB, hf_config
from torch.utils.data import DataLoader, Dataset, DistributedSampler

hf_env.require("transformers")


class PromptResponses(Dataset):
    """``n`` samples of ``lo..hi`` tokens; the first ``1..t/2`` (the prompt) labelled -100."""

    def __init__(self, n: int = 32, lo: int = 5, hi: int = 24, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            t = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (t,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(1, max(2, t // 2 + 1), (1,), generator=g))] = -100
            self.items.append((ids, labels))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def pad_to_longest(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding: the batch is as long as its longest sample."""
    t = max(len(ids) for ids, _ in items)
    batch = {
        "input_ids": torch.zeros(len(items), t, dtype=torch.long),
        "attention_mask": torch.zeros(len(items), t, dtype=torch.long),
        "labels": torch.full((len(items), t), -100, dtype=torch.long),
    }
    for row, (ids, labels) in enumerate(items):
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
        batch["labels"][row, : len(ids)] = labels
    return batch


def finetune_loader(data: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, collate_fn=pad_to_longest)


def reference_finetune_loader(data: Dataset, global_batch_size: int) -> DataLoader:
    """One process, the samples N ranks (x accumulated batches) see together in one batch per step."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=global_batch_size, sampler=sampler, collate_fn=pad_to_longest)


def lora(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters on the attention's q and v projections."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    adapted = get_peft_model(model, config)
    for name, p in adapted.named_parameters():  # peft starts B at zero: give the adapters a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return adapted


class FineTune(L.LightningModule):
    """A Hugging Face Llama fine-tuned on prompt/response data, the loss taken one of two ways.

    * ``loss="model"``: ``self.model(input_ids, attention_mask, labels=labels).loss``, the model's own
      token mean over the shifted labels;
    * ``loss="step"``: ``F.cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index=-100)`` in the step.

    ``adapters=True``: the model is wrapped by peft (LoRA; its base weights frozen). Two blocks: one a
    stage at pipeline size 2 (a traced fit's export and cut into stages cost per block).
    """

    def __init__(
        self, loss: str = "model", adapters: bool = False, lr: float = 1e-2, seed: int = 0, layers: int = 2
    ) -> None:
        super().__init__()
        import transformers as tf

        self.save_hyperparameters()
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(hf_config("llama", tied=False, layers=layers))
        self.model = lora(model) if adapters else model
        self.loss_style, self.lr = loss, lr

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        if self.loss_style == "model":
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        # SGD: a parameter's difference from one device is lr x its gradient's difference (AdamW would
        # turn rounding noise of near-zero gradients into full steps).
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def labelled_in(batch: dict[str, torch.Tensor]) -> int:
    """What both loss styles average over: the labels after the first position that are not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())
