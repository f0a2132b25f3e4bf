"""The supervised finetuning loss: the mean cross-entropy over the batch's assistant tokens (TRL's SFT loss with
``assistant_only_loss``), each packed conversation attending only to itself; the cross-entropy
--loss-chunk-tokens tokens at a time when the model's layout says so (the same loss, less fp32 memory)."""
from __future__ import annotations

import torch

from finetune.lm.packing import LMBatch
from models.documents import document_parallel_logits
from models.parallel import vocab_parallel_cross_entropy


def sft_loss(model, batch: LMBatch, reduction: str = "mean") -> torch.Tensor:
    logits = document_parallel_logits(model, batch.input_ids, batch.documents)
    return vocab_parallel_cross_entropy(logits, batch.targets, vocab_size=model.config.vocab_size,
                                        reduction=reduction, chunk_tokens=model.layout.loss_chunk_tokens or None)
