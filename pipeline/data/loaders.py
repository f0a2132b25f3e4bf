"""Batch loaders for data-parallel training, resumable exactly from a ``state_dict``.

Data parallelism: each DP rank reads a disjoint shard; the TP and PP ranks of one DP slot pass the same
``dp_rank`` and so get the same batch.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.data.packing import PackedSequences, StreamingSequences

_VERSION = 1


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(seed), int(epoch), salt]))


class DistributedBatchLoader:
    """Endless ``{"tokens": LongTensor[micro_batch_size, seq_length + 1]}`` batches, epoch after epoch.

    Map-style sequences (``len`` + ``[i]``), Megatron-style: each epoch is a permutation of all sequences
    drawn from ``(seed, epoch)``; it is cut into global micro-batches of ``micro_batch_size *
    dp_world_size`` sequences (the incomplete tail is left out, a different one each epoch), and DP rank
    r takes the r-th ``micro_batch_size`` slice of each. The position is the number of sequences consumed
    in the epoch, so a resumed run sees exactly the batches an uninterrupted one sees, and a resume with
    another DP size keeps the global order.

    Streaming sequences (:class:`StreamingSequences`): rank r reads its own share of the documents
    (``split_dataset_by_node``) in stream order (``shuffle`` does not apply) and packs it; the position
    is that of the document stream plus the partly used batch of documents.
    """

    def __init__(self, sequences, micro_batch_size: int, dp_rank: int, dp_world_size: int, seed: int = 1234,
                 shuffle: bool = True):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        self.sequences = sequences
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank, self.dp_world_size = int(dp_rank), int(dp_world_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch = 0
        self.streaming = isinstance(sequences, StreamingSequences)
        if self.streaming:
            self._stream = sequences.shard(self.dp_rank, self.dp_world_size).iterator()
            return
        self.num_sequences = len(sequences)
        self.global_batch = self.micro_batch_size * self.dp_world_size
        if self.num_sequences < self.global_batch:
            raise ValueError(
                f"{getattr(sequences, 'name', 'the data')} has {self.num_sequences} sequences, fewer than one "
                f"global micro-batch ({self.micro_batch_size} x {self.dp_world_size} DP ranks = "
                f"{self.global_batch}); use more data, a shorter sequence length or a smaller batch")
        self.consumed = 0  # sequences of this epoch taken by all DP ranks together
        self._order_epoch, self._order = None, None

    def __len__(self) -> int:
        """Batches per epoch on this rank (map-style only)."""
        if self.streaming:
            raise TypeError("a streaming loader has no length")
        return self.num_sequences // self.global_batch

    def __iter__(self):
        return self

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = (_rng(self.seed, self.epoch, 0).permutation(self.num_sequences) if self.shuffle
                           else np.arange(self.num_sequences))
            self._order_epoch = self.epoch
        return self._order

    def __next__(self) -> dict:
        if self.streaming:
            rows = [next(self._stream) for _ in range(self.micro_batch_size)]
            self.epoch = self._stream.epoch
            return {"tokens": torch.stack(rows)}
        if self.consumed + self.global_batch > self.num_sequences:
            self.epoch += 1
            self.consumed = 0
        start = self.consumed + self.dp_rank * self.micro_batch_size
        indices = self._epoch_order()[start:start + self.micro_batch_size]
        self.consumed += self.global_batch
        return {"tokens": torch.stack([self.sequences[int(i)] for i in indices])}

    def state_dict(self) -> dict:
        if self.streaming:
            return {"version": _VERSION, "kind": "stream", "dp_rank": self.dp_rank,
                    "dp_world_size": self.dp_world_size, "stream": self._stream.state_dict()}
        return {"version": _VERSION, "kind": "map", "epoch": self.epoch, "consumed": self.consumed,
                "seed": self.seed, "shuffle": self.shuffle, "num_sequences": self.num_sequences}

    def load_state_dict(self, state: dict) -> None:
        kind = "stream" if self.streaming else "map"
        if state.get("kind") != kind:
            raise ValueError(f"cannot resume a {kind} data loader from a {state.get('kind')!r} loader state")
        if self.streaming:
            if (state["dp_rank"], state["dp_world_size"]) != (self.dp_rank, self.dp_world_size):
                raise ValueError(
                    f"this streaming loader state belongs to DP rank {state['dp_rank']} of "
                    f"{state['dp_world_size']}, not {self.dp_rank} of {self.dp_world_size}: a streamed "
                    f"corpus resumes only on the same data-parallel layout")
            self._stream.load_state_dict(state["stream"])
            self.epoch = self._stream.epoch
            return
        for key in ("seed", "shuffle", "num_sequences"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the data loader state does not fit this data: {key} was {state[key]!r} at the checkpoint "
                    f"and is {getattr(self, key)!r} now (changed --data, sequence length, tokenizer or seed?)")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class StreamBatchLoader:
    """Contiguous token streams for truncated BPTT (the character-level mLSTM).

    Every batch is ``{"tokens": LongTensor[micro_batch_size, bptt_length + 1], "reset": BoolTensor[micro]}``:
    row j continues its own stream from one batch to the next (consecutive windows share one token: the
    last target of a window is the first input of the next), and ``reset`` is True where a row's stream
    (re)starts, so the model zeroes the hidden state it carries there.

    Map-style source (a :class:`PackedSequences`' flat tokens, or a 1-D tensor/array): the token stream is
    rotated each epoch by an offset drawn from ``(seed, epoch)`` and cut into ``dp_world_size *
    micro_batch_size`` equal contiguous rows; DP rank r owns rows ``[r * micro, (r + 1) * micro)``; batch
    b gives each row its tokens ``[b * bptt, b * bptt + bptt + 1)``. ``reset`` is True for every row at
    the start of each epoch.

    Streaming source (:class:`StreamingSequences`): the rank's share of the documents is packed into one
    continuous token stream, dealt out in consecutive segments of ``segment_windows * bptt_length + 1``
    tokens, one per row; each row reads its segment window by window, and after ``segment_windows``
    batches every row gets the next segment (``reset`` True then). Memory holds one segment per row.
    """

    def __init__(self, token_source, micro_batch_size: int, bptt_length: int, dp_rank: int, dp_world_size: int,
                 seed: int = 1234, segment_windows: int = 256):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        if micro_batch_size < 1 or bptt_length < 1:
            raise ValueError(f"micro_batch_size and bptt_length must be >= 1, got {micro_batch_size}, {bptt_length}")
        self.micro_batch_size, self.bptt_length = int(micro_batch_size), int(bptt_length)
        self.dp_rank, self.dp_world_size, self.seed = int(dp_rank), int(dp_world_size), int(seed)
        self.rows = self.micro_batch_size * self.dp_world_size
        self.epoch, self.batch = 0, 0
        self.streaming = isinstance(token_source, StreamingSequences)
        if self.streaming:
            self.segment_windows = int(segment_windows)
            segments = StreamingSequences(token_source.documents, token_source.tokenizer,
                                          self.segment_windows * self.bptt_length, name=token_source.name,
                                          files=token_source.files, doc_batch_size=token_source.doc_batch_size)
            self._segments = segments.shard(self.dp_rank, self.dp_world_size).iterator()
            self._dealt_state, self._rows = None, None
            return
        if isinstance(token_source, PackedSequences):
            self._read, self.num_tokens = token_source.tokens, token_source.num_tokens
        else:
            array = np.asarray(token_source.numpy() if isinstance(token_source, torch.Tensor) else token_source)
            if array.ndim != 1:
                raise ValueError(f"token_source must be 1-D, got shape {array.shape}")
            self._read, self.num_tokens = (lambda a, b: array[a:b]), int(array.shape[0])
        self.row_length = self.num_tokens // self.rows
        self.batches_per_epoch = (self.row_length - 1) // self.bptt_length
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{self.num_tokens} tokens cut into {self.rows} rows ({self.micro_batch_size} x "
                f"{self.dp_world_size} DP ranks) give {self.row_length} tokens per row, fewer than one window of "
                f"bptt_length + 1 = {self.bptt_length + 1}; use more data, a shorter bptt or fewer rows")
        self._offset_epoch, self._offset = None, 0

    def __len__(self) -> int:
        """Batches per epoch (map-style) or per segment (streaming)."""
        return self.segment_windows if self.streaming else self.batches_per_epoch

    def __iter__(self):
        return self

    def _epoch_offset(self) -> int:
        if self._offset_epoch != self.epoch:
            self._offset = int(_rng(self.seed, self.epoch, 1).integers(self.num_tokens))
            self._offset_epoch = self.epoch
        return self._offset

    def _window(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens of the epoch's rotated stream from ``start`` (wrapping at the end)."""
        a = (self._epoch_offset() + start) % self.num_tokens
        if a + length <= self.num_tokens:
            return self._read(a, a + length)
        return np.concatenate([self._read(a, self.num_tokens), self._read(0, a + length - self.num_tokens)])

    def _deal(self) -> None:
        self._dealt_state = self._segments.state_dict()
        self._rows = [next(self._segments) for _ in range(self.micro_batch_size)]
        self.epoch = self._segments.epoch

    def __next__(self) -> dict:
        length = self.bptt_length + 1
        if self.streaming:
            if self._rows is None or self.batch >= self.segment_windows:
                self._deal()
                self.batch = 0
            start = self.batch * self.bptt_length
            tokens = torch.stack([row[start:start + length] for row in self._rows])
        else:
            if self.batch >= self.batches_per_epoch:
                self.epoch, self.batch = self.epoch + 1, 0
            first_row = self.dp_rank * self.micro_batch_size
            rows = [self._window((first_row + j) * self.row_length + self.batch * self.bptt_length, length)
                    for j in range(self.micro_batch_size)]
            tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
        reset = torch.full((self.micro_batch_size,), self.batch == 0, dtype=torch.bool)
        self.batch += 1
        return {"tokens": tokens, "reset": reset}

    def state_dict(self) -> dict:
        if self.streaming:
            return {"version": _VERSION, "kind": "bptt-stream", "segments": self._dealt_state,
                    "dealt": self._rows is not None, "batch": self.batch, "rows": self.rows,
                    "bptt_length": self.bptt_length, "segment_windows": self.segment_windows,
                    "dp_rank": self.dp_rank}
        return {"version": _VERSION, "kind": "bptt", "epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                "num_tokens": self.num_tokens, "rows": self.rows, "bptt_length": self.bptt_length}

    def load_state_dict(self, state: dict) -> None:
        kind = "bptt-stream" if self.streaming else "bptt"
        if state.get("kind") != kind:
            raise ValueError(f"cannot resume a {kind} loader from a {state.get('kind')!r} loader state")
        keys = ("rows", "bptt_length", "segment_windows", "dp_rank") if self.streaming else \
            ("seed", "num_tokens", "rows", "bptt_length")
        for key in keys:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the stream loader state does not fit: {key} was {state[key]!r} at the checkpoint and is "
                    f"{getattr(self, key)!r} now (rows = micro_batch_size x dp_world_size); the streams "
                    f"cannot continue exactly")
        self.batch = int(state["batch"])
        if not self.streaming:
            self.epoch = int(state["epoch"])
            return
        self._rows = None
        if state["dealt"]:  # re-deal the segments the rows were reading, from the stream position then
            self._segments.load_state_dict(state["segments"])
            self._deal()
