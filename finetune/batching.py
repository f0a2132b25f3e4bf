"""Texts -> token ids -> right-padded batches, for training (shuffled, sharded over data-parallel ranks) and for
prediction (sorted by length, so that a batch wastes little on padding).

Right padding with the lengths alongside: the classifier reads position ``length - 1`` (last-token pooling)
or masks the padding (mean/max/attention pooling), and under causal attention no real token sees a pad.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm


def encode_texts(tokenizer, texts: Sequence[str], max_length: int, suffix: Sequence[int] = ()) -> list[list[int]]:
    """Token ids of each text, cut to its first ``max_length`` tokens, then ``suffix`` (a label prompt). A text
    that encodes to nothing is refused (its row would have no token to classify from)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    encoded = tokenizer.encode_batch(list(texts))
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"text {i} ({texts[i]!r:.60}) encodes to no tokens")
    suffix = list(suffix)
    return [ids[:max_length] + suffix for ids in encoded]


LABEL_PROMPT_SEPARATOR = "\nEmotions:"


def label_prompt(tokenizer, label_names: Sequence[str],
                 separator: str = LABEL_PROMPT_SEPARATOR) -> tuple[list[int], list[int]]:
    """(token ids, each label's last-token index in them) of the prompt that ends every text under pooling
    "labels": the separator, then each label name after a space (" anger", " anticipation", ...), so that
    label k's vector is read where its name ends, having read the text and the names before it."""
    parts = tokenizer.encode_batch([separator] + [f" {name.replace('_', ' ')}" for name in label_names])
    if not all(parts):
        raise ValueError(f"the label prompt {separator!r} + label names {list(label_names)} encodes to no tokens")
    ids, positions = list(parts[0]), []
    for word in parts[1:]:
        ids += word
        positions.append(len(ids) - 1)
    return ids, positions


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids long [b, max length], lengths long [b]), right padded with ``pad_id``."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
    return ids, lengths


class TrainBatches:
    """Endless micro-batches ``{"input_ids", "lengths", "labels"}`` for one data-parallel rank; from pooled
    features [n, h] instead of token ids (a frozen encoder's, computed once): ``{"pooled", "labels"}``.

    Each epoch is a permutation of the examples drawn from ``(seed, epoch)``, cut into global micro-batches of
    ``micro_batch_size x dp_world_size`` examples; DP rank r takes the r-th slice of each. The permutation's
    tail of fewer than a global batch (``global_batch_size``, an optimizer step's examples; default one global
    micro-batch) is left out, a different one each epoch, so that a step takes the same examples at every
    layout (micro-batch, accumulation, DP size). Ranks of one DP slot (TP peers) get the same batches.

    ``group_by_length=N`` (token ids only) batches texts of similar length together, so that a batch is padded
    to little more than its texts: the permutation is cut into pools of N global batches (``global_batch_size``,
    an optimizer step's examples), each pool sorted by length and cut into global batches, and the global
    batches of the epoch shuffled. Every epoch covers the same examples as without grouping, and the order is
    a function of ``(seed, epoch)`` alone, so a resumed run sees the batches it would have seen.
    """

    def __init__(self, encoded: Sequence[Sequence[int]] | torch.Tensor, labels: np.ndarray, micro_batch_size: int,
                 dp_rank: int, dp_world_size: int, pad_id: int, seed: int = 1234, group_by_length: int = 0,
                 global_batch_size: int | None = None):
        if len(encoded) != len(labels):
            raise ValueError(f"{len(encoded)} encoded texts for {len(labels)} label rows")
        self.encoded, self.labels = encoded, torch.as_tensor(np.asarray(labels), dtype=torch.float32)
        self.micro, self.rank, self.dp = int(micro_batch_size), int(dp_rank), int(dp_world_size)
        self.global_micro = self.micro * self.dp
        if len(encoded) < self.global_micro:
            raise ValueError(f"{len(encoded)} training examples are fewer than one global micro-batch "
                             f"({self.micro} x {self.dp} data-parallel ranks)")
        if group_by_length < 0:
            raise ValueError(f"group_by_length must be >= 0, got {group_by_length}")
        self.pad_id, self.seed = int(pad_id), int(seed)
        self.lengths = None if isinstance(encoded, torch.Tensor) or not group_by_length else \
            np.array([len(ids) for ids in encoded])
        self.step_batch = int(global_batch_size or self.global_micro)
        if self.step_batch % self.global_micro:
            raise ValueError(f"global batch {self.step_batch} is not a multiple of {self.global_micro} "
                             f"({self.micro} x {self.dp} data-parallel ranks)")
        self.pool = int(group_by_length) * self.step_batch
        self.epoch, self.consumed = 0, 0
        self._order = None

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        if self.consumed + self.global_micro > len(self._order):
            self.epoch, self.consumed = self.epoch + 1, 0
            self._order = self.epoch_order(self.epoch)
        start = self.consumed + self.rank * self.micro
        idx = self._order[start:start + self.micro]
        self.consumed += self.global_micro
        labels = self.labels[torch.as_tensor(idx)]
        if isinstance(self.encoded, torch.Tensor):
            return {"pooled": self.encoded[torch.as_tensor(idx)], "labels": labels}
        ids, lengths = pad_batch([self.encoded[i] for i in idx], self.pad_id)
        return {"input_ids": ids, "lengths": lengths, "labels": labels}

    def state_dict(self) -> dict:
        """The position in the ``(seed, epoch)`` order: the epoch and its examples taken so far (over all DP
        ranks, so the same at every layout)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "examples": len(self.encoded)}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["examples"]) != (self.seed, len(self.encoded)):
            raise ValueError(f"the saved position is one of {state['examples']} examples at seed {state['seed']}, "
                             f"these batches hold {len(self.encoded)} at seed {self.seed}")
        self.epoch, self.consumed, self._order = int(state["epoch"]), int(state["consumed"]), None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The example indices of one epoch, in the order the global micro-batches take them."""
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 17]))
        order = rng.permutation(len(self.encoded))
        order = order[:len(order) - len(order) % self.step_batch]  # the tail left out: no step spans two epochs
        if self.lengths is None:
            return order
        batches = []
        for start in range(0, len(order), self.pool):
            pool = order[start:start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches += [pool[i:i + self.step_batch] for i in range(0, len(pool), self.step_batch)]
        return np.concatenate([batches[i] for i in rng.permutation(len(batches))])


def auto_micro_batch(per_rank_batch: int, sequence_bytes: float, budget_bytes: float) -> int:
    """The largest micro-batch that divides a rank's share of the global batch and whose activations
    (``sequence_bytes`` per sequence) fit in ``budget_bytes``: the fewest, largest matrix products a step
    can have (a CPU's or GPU's efficiency grows with the rows per product). At least 1."""
    if per_rank_batch < 1:
        raise ValueError(f"per_rank_batch must be >= 1, got {per_rank_batch}")
    fitting = [m for m in range(1, per_rank_batch + 1)
               if per_rank_batch % m == 0 and m * sequence_bytes <= budget_bytes]
    return max(fitting, default=1)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Index arrays of batches of similar lengths (longest first, so a memory problem shows at once)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def predict_encoded(model, encoded: Sequence[Sequence[int]], pad_id: int, *, batch_size: int = 64,
                    dp_rank: int = 0, dp_world_size: int = 1, dp_group=None, progress: bool = False,
                    desc: str = "predict") -> np.ndarray:
    """Probabilities float32 [n, k] of a ``Classifier`` (or an engine's module) for token id lists.

    With several data-parallel ranks each computes every ``dp_world_size``-th batch and the results are
    summed over ``dp_group`` (collective: every rank of the group calls it)."""
    def run(ids, lengths):
        return model.head.probabilities(model(ids, lengths=lengths))
    return _over_batches(model, run, encoded, pad_id, batch_size, dp_rank, dp_world_size, dp_group, progress,
                         desc).numpy()


@torch.no_grad()
def pooled_features(model, encoded: Sequence[Sequence[int]], pad_id: int, *, batch_size: int = 64,
                    dp_rank: int = 0, dp_world_size: int = 1, dp_group=None, progress: bool = False,
                    desc: str = "features") -> torch.Tensor:
    """The head's inputs float32 [n, h] (encoder features pooled), split over DP ranks like ``predict_encoded``."""
    def run(ids, lengths):
        return model.pool(ids, lengths=lengths).float()
    return _over_batches(model, run, encoded, pad_id, batch_size, dp_rank, dp_world_size, dp_group, progress, desc)


@torch.no_grad()
def predict_pooled(model, pooled: torch.Tensor, *, batch_size: int = 1024) -> np.ndarray:
    """Probabilities float32 [n, k] from pooled features [n, h] (the head alone)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = [model.head.probabilities(model(pooled=pooled[i:i + batch_size].to(device))).cpu()
               for i in range(0, len(pooled), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(out).numpy()


def _over_batches(model, run, encoded, pad_id, batch_size, dp_rank, dp_world_size, dp_group, progress,
                  desc) -> torch.Tensor:
    device = next(model.parameters()).device
    every = length_sorted_batches([len(s) for s in encoded], batch_size)
    mine = every[dp_rank::dp_world_size]
    # every rank runs as many forwards as the busiest one (an expert-parallel MoE layer's all-to-all joins the
    # ranks in each forward): a rank with fewer runs the first batch again and keeps nothing of it
    spare = -(-len(every) // dp_world_size) - len(mine)
    out = None
    was_training = model.training
    model.eval()
    try:
        for idx, keep in tqdm([(b, True) for b in mine] + [(every[0], False)] * spare, desc=desc,
                              disable=not progress, leave=False, dynamic_ncols=True):
            ids, lengths = pad_batch([encoded[i] for i in idx], pad_id)
            values = run(ids.to(device), lengths.to(device)).float().cpu()
            if out is None:
                out = torch.zeros(len(encoded), values.shape[1], dtype=torch.float32)
            if keep:
                out[torch.as_tensor(idx)] = values
    finally:
        model.train(was_training)
    if dp_world_size > 1:
        width = torch.tensor([0 if out is None else out.shape[1]], device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)
        total = (out if out is not None else torch.zeros(len(encoded), int(width))).to(device)
        dist.all_reduce(total, group=dp_group)
        out = total.cpu()
    return out
