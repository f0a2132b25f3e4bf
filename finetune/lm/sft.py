"""The supervised finetuning loss: the mean cross-entropy over the batch's assistant tokens (TRL's SFT loss with
``assistant_only_loss``), each packed conversation attending only to itself; the cross-entropy
--loss-chunk-tokens tokens at a time when the model's layout says so (the same loss, less fp32 memory)."""
from __future__ import annotations

import torch

from finetune.lm.packing import LMBatch


def sft_loss(model, batch: LMBatch, reduction: str = "mean") -> torch.Tensor:
    """The model's own loss over the packed rows (at any layout its forward takes), plus in training with a mean
    reduction the MoE layers' auxiliary losses, as in pretraining."""
    return model(batch.input_ids, batch.targets, reduction=reduction, documents=batch.documents)
