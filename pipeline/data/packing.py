"""Tokenize documents and pack them into fixed-length training sequences.

Documents are joined into one token stream, each followed by the end-of-document id (empty documents are
dropped), and the stream is cut into sequences of ``seq_length + 1`` tokens with stride ``seq_length``
(Megatron's layout: the last token of one sequence is the first of the next, so every token is a
prediction target exactly once and nothing is padded). A document longer than ``seq_length`` simply
continues into the next sequence(s); a short one shares its sequence with its neighbours. The final
``< seq_length`` tokens that cannot fill a sequence are left out.

Map-style: ``datasets.map(batched=True, num_proc=...)`` writes the token ids (uint16 when the vocabulary
fits) to Arrow files in the on-disk cache, keyed by the dataset and the tokenizer fingerprint; the packed
sequences are a zero-copy view over those memory-mapped files. Streaming: documents are tokenized a batch
at a time as they arrive; memory holds one batch of documents plus one sequence.
"""
from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from datasets.distributed import split_dataset_by_node

from pipeline.data.sources import DataSourceError, explain_read_error
from pipeline.data.tokenizer import Tokenizer

_CACHE_VERSION = "pack-v1"  # bump when the tokenized layout changes, to invalidate old cache files


def token_dtype(tokenizer: Tokenizer):
    return np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class TokenizeDocuments:
    """``datasets.map`` function: a batch of texts -> one row of ids (document + eod) per non-empty text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.dtype = token_dtype(tokenizer)

    def __call__(self, texts):
        flat, lengths = self.tokenizer.encode_documents(texts, dtype=self.dtype)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)  # a batch holds < 2**31 tokens
        return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))})


def work_dir(cache_dir: str | None) -> str:
    """Where our derived files (token ids, split indices) go: ``cache_dir``, else a folder of the datasets
    cache; never next to the user's data (a save_to_disk directory may be read-only or shared)."""
    path = Path(cache_dir) if cache_dir is not None else Path(datasets.config.HF_DATASETS_CACHE) / "pipeline-data"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def tokenize_dataset(ds: datasets.Dataset, tokenizer: Tokenizer, *, num_proc: int | None = None,
                     cache_dir: str | None = None, desc: str = "tokenizing") -> datasets.Dataset:
    """``ds`` (column ``text``) -> column ``input_ids``, cached on disk under the dataset + tokenizer."""
    key = hashlib.sha256(f"{_CACHE_VERSION}|{ds._fingerprint}|{tokenizer.fingerprint()}".encode()).hexdigest()[:24]
    cache_file = os.path.join(work_dir(cache_dir), f"tokenized-{key}.arrow")
    return ds.with_format("arrow").map(
        _ArrowTexts(TokenizeDocuments(tokenizer)), batched=True, batch_size=1000, num_proc=num_proc,
        remove_columns=ds.column_names, new_fingerprint=key, cache_file_name=cache_file,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value(np.dtype(token_dtype(tokenizer)).name))}),
        desc=desc).with_format(None)


class _ArrowTexts:
    """Adapts a texts -> table function to ``map`` over Arrow-formatted batches (no Python dicts)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, batch: pa.Table):
        return self.fn(batch.column("text").to_pylist())


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length sequences over the concatenated ``input_ids`` of a tokenized dataset.

    ``len()`` sequences; ``[i]`` is a LongTensor of ``seq_length + 1`` tokens starting at token
    ``i * seq_length``. ``tokens(a, b)`` reads the flat stream (used by the BPTT stream loader).
    """

    def __init__(self, tokenized: datasets.Dataset, seq_length: int, name: str = "data"):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.dataset = tokenized
        self.seq_length = int(seq_length)
        self.name = name
        self._chunks = None
        self._setup()

    def _setup(self):
        table = self.dataset.with_format("arrow")._data  # memory-mapped cache files
        if self.dataset._indices is not None:
            table = self.dataset.flatten_indices()._data
        chunks = []
        for chunk in table.column("input_ids").chunks:
            values = chunk.flatten()
            if len(values):
                chunks.append(values.to_numpy(zero_copy_only=True))
        self._chunks = chunks
        sizes = np.array([len(c) for c in chunks], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._starts[-1])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_chunks"] = None  # numpy views of mmaps: rebuilt after unpickling
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._setup()

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_length)

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sequence {index} out of range for {n} sequences")
        start = (index % n) * self.seq_length
        return torch.from_numpy(self.tokens(start, start + self.seq_length + 1).astype(np.int64))

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the packed stream (copies only when the range spans Arrow chunks)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, stop, side="left"))
        pieces = [self._chunks[c][max(start, self._starts[c]) - self._starts[c]:
                                   min(stop, self._starts[c + 1]) - self._starts[c]]
                  for c in range(first, max(last, first + 1))]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __repr__(self) -> str:
        return (f"PackedSequences({self.name}: {len(self)} x {self.seq_length + 1} tokens, "
                f"{self.num_tokens} tokens)")


class StreamingSequences:
    """Iterable of packed sequences from a streamed document dataset (``datasets.IterableDataset``).

    ``iter()`` runs one pass; :meth:`iterator` gives an endless, resumable iterator (epoch after epoch)
    with ``state_dict``; :meth:`shard` gives a data-parallel rank's disjoint share of the documents.
    """

    def __init__(self, documents: datasets.IterableDataset, tokenizer: Tokenizer, seq_length: int, *,
                 name: str = "data", files=(), doc_batch_size: int = 1000):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_length = int(seq_length)
        self.name = name
        self.files = list(files)  # to name the file at fault when a read fails mid-stream
        self.doc_batch_size = doc_batch_size

    def shard(self, rank: int, world_size: int) -> "StreamingSequences":
        if world_size == 1:
            return self
        return StreamingSequences(split_dataset_by_node(self.documents, rank=rank, world_size=world_size),
                                  self.tokenizer, self.seq_length, name=f"{self.name}[{rank}/{world_size}]",
                                  files=self.files, doc_batch_size=self.doc_batch_size)

    def iterator(self, *, epochs: int | None = None) -> "PackingIterator":
        return PackingIterator(self, epochs=epochs)

    def __iter__(self):
        return self.iterator(epochs=1)

    def __repr__(self) -> str:
        return f"StreamingSequences({self.name}: streamed, {self.seq_length + 1} tokens per sequence)"


class PackingIterator:
    """Packs a document stream into sequences, resumable exactly from :meth:`state_dict`.

    The state is the document stream's position (``IterableDataset.state_dict``) at the start of the
    current batch of documents, the < seq_length + 1 tokens carried in from before it, and how many
    sequences of this batch were already yielded: resuming re-reads and re-tokenizes that one batch.
    """

    def __init__(self, stream: StreamingSequences, epochs: int | None = None):
        self.stream = stream
        self.epochs = epochs
        self.epoch = 0
        self._start_state = None
        self._carry: list[int] = []
        self._skip = 0
        self._pending: np.ndarray | None = None
        self._doc_iter = None
        self._docs = None
        self._whole_epoch_tokens = None  # None: this epoch was resumed midway, so its count is unknown

    # -- document side -------------------------------------------------------------------------------
    def _open_epoch(self, doc_state=None):
        docs = copy.deepcopy(self.stream.documents).with_format("arrow")  # batches as Arrow tables
        docs.set_epoch(self.epoch)
        if doc_state is not None:
            docs.load_state_dict(doc_state)
        self._docs = docs
        self._doc_iter = docs.iter(batch_size=self.stream.doc_batch_size)

    def _next_doc_batch(self) -> list[str] | None:
        """The next ``doc_batch_size`` documents (fewer at the end of the stream); None when it is over."""
        try:
            table = next(self._doc_iter)
        except StopIteration:
            return None
        except Exception as e:
            raise explain_read_error(e, self.stream.files, self.stream.name) from e
        texts = table.column("text").to_pylist()
        if any(t is None for t in texts):
            raise DataSourceError(f"{self.stream.name}: a record has a null text field; give each record a text or "
                                  f"drop those records")
        return texts

    def _fill(self) -> None:
        """Tokenize the next document batch into the pending buffer, crossing epochs as needed."""
        while True:
            if self._doc_iter is None:
                self._open_epoch()
                self._whole_epoch_tokens = 0  # counted only for epochs read from their start
            self._start_state = self._docs.state_dict()
            texts = self._next_doc_batch()
            if texts is not None:
                break
            self._doc_iter = None
            if self._whole_epoch_tokens == 0:
                raise ValueError(f"{self.stream.name}: the stream has no text (an empty corpus, or a "
                                 f"data-parallel shard that received no documents)")
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                raise StopIteration
            self.epoch += 1
        flat, _ = self.stream.tokenizer.encode_documents(texts, dtype=np.int32)  # int32 halves the buffer
        if self._whole_epoch_tokens is not None:
            self._whole_epoch_tokens += len(flat)
        self._pending = np.concatenate([np.asarray(self._carry, dtype=np.int32), flat])
        self._carry_at_start = list(self._carry)
        self._skip = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        L = self.stream.seq_length
        while True:
            if self._pending is not None:
                start = self._skip * L
                if start + L + 1 <= len(self._pending):
                    self._skip += 1
                    return torch.from_numpy(self._pending[start:start + L + 1].astype(np.int64))
                self._carry = self._pending[start:].tolist()
                self._pending = None
            self._fill()

    def state_dict(self) -> dict:
        if self._pending is None:  # between batches: resume opens the next batch
            return {"epoch": self.epoch, "docs": self._docs.state_dict() if self._docs is not None else None,
                    "carry": list(self._carry), "skip": 0, "in_batch": False}
        return {"epoch": self.epoch, "docs": self._start_state, "carry": list(self._carry_at_start),
                "skip": self._skip, "in_batch": True}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self._pending = None
        self._carry = list(state["carry"])
        self._open_epoch(state["docs"])
        self._whole_epoch_tokens = None
        if state["in_batch"]:
            self._fill()
            self._skip = int(state["skip"])
