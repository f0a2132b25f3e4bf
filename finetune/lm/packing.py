"""Tokenized conversations packed into rows of ``seq_length`` tokens with their boundaries kept, and batches of
them for the project's GPT.

Packing is TRL's best-fit decreasing (``trl.pack_dataset(strategy="bfd")``, the default of ``SFTTrainer``): whole
conversations share a row, a longer one is cut to ``seq_length``, and each row records its ``seq_lengths``. The
pretraining stream's packing (pipeline/data/packing.py) cuts documents across rows, so a conversation's end would
lose its beginning; here none does. The attention stays inside each conversation (``models.documents``), so a
packed batch gives the loss of the same conversations one per row.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import datasets
import torch
from trl import pack_dataset

from finetune.lm.chat import IGNORE_INDEX
from models.documents import DocumentAttention


def pack_conversations(tokenized: datasets.Dataset, seq_length: int) -> datasets.Dataset:
    """Columns ``input_ids``, ``labels``, ``seq_lengths``: rows of at most ``seq_length`` tokens."""
    return pack_dataset(tokenized.select_columns(["input_ids", "labels"]), seq_length, strategy="bfd")


def unpacked(tokenized: datasets.Dataset, seq_length: int) -> datasets.Dataset:
    """One conversation per row, cut to ``seq_length`` as packing cuts it (the reference packing must equal)."""
    def one(record):
        ids, labels = record["input_ids"][:seq_length], record["labels"][:seq_length]
        return {"input_ids": ids, "labels": labels, "seq_lengths": [len(ids)]}
    return tokenized.select_columns(["input_ids", "labels"]).map(one)


@dataclass
class LMBatch:
    input_ids: torch.Tensor          # [b, s]
    targets: torch.Tensor            # [b, s]: the next token where it is an assistant token of the same document
    documents: DocumentAttention     # boundaries and positions

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device) -> LMBatch:
        documents = copy.copy(self.documents)
        for name in ("document_ids", "positions", "attn_mask"):
            setattr(documents, name, getattr(documents, name).to(device))
        return LMBatch(self.input_ids.to(device), self.targets.to(device), documents)


def collate(rows: list[dict], seq_length: int, pad_id: int) -> LMBatch:
    """A batch of ``seq_length`` tokens per row from rows with ``input_ids``, ``labels`` (unshifted) and
    ``seq_lengths``; a short row is padded with ``pad_id`` as a document of its own that scores nothing."""
    ids = torch.full((len(rows), seq_length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), seq_length), IGNORE_INDEX, dtype=torch.long)
    lengths = []
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[r, :n] = torch.tensor(row["input_ids"])
        labels = torch.tensor(row["labels"])
        start = 0
        for length in row["seq_lengths"]:  # a document's last token predicts nothing (the next is another's)
            targets[r, start:start + length - 1] = labels[start + 1:start + length]
            start += length
        lengths.append(list(row["seq_lengths"]) + ([seq_length - n] if n < seq_length else []))
    return LMBatch(ids, targets, DocumentAttention(lengths))
