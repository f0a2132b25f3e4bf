"""Pretraining data flow: any corpus -> tokenized -> packed -> sharded over DP ranks -> resumable batches.

    tok = load_tokenizer("path/to/gpt2")          # or "bytes", "train-bpe", a tokenizer.json
    train, valid = build_pretraining_data("corpus/*.txt", tok, seq_length=1024)
    loader = DistributedBatchLoader(train, micro_batch_size=8, dp_rank=r, dp_world_size=w)
    batch = next(loader)["tokens"]                 # LongTensor [8, 1025]
    state = loader.state_dict()                    # into the checkpoint; load_state_dict to resume
    tok.save(checkpoint_dir); check_same_tokenizer(checkpoint_dir, tok)   # on resume / evaluation

Documented behaviours (each bad input otherwise gets a DataSourceError / FileNotFoundError naming the
source, file, field or byte):

- Documents: a .txt file's blank-line separated paragraphs (``txt_sample_by``: "line" | "paragraph" |
  "document"); one row of json/csv/tsv/parquet/save_to_disk/hub data (``text_field``). Empty documents
  are dropped; 0-byte files are skipped with a warning; a source without documents is an error.
- Packing: documents joined, each followed by ``eod_id``; sequences of ``seq_length + 1`` tokens with
  stride ``seq_length``; a document longer than ``seq_length`` is simply cut across consecutive
  sequences; no padding; the last partial sequence is dropped. A literal "<|endoftext|>" inside a
  document is ordinary text, not a boundary.
- Undecodable bytes: refused by default, naming the file, byte offset and line; ``encoding_errors=
  "replace"`` reads them as U+FFFD instead (text/json/csv).
- Hub names with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set: only the local datasets cache is consulted,
  and a miss fails at once; no network attempt.
- Streaming: documents in stream order (no shuffle buffer: resume is exact), memory bounded by one batch
  of documents; validation is the documents whose seeded content hash falls under ``valid_fraction``.
"""
from pipeline.data.build import build_pretraining_data, main_process_first
from pipeline.data.loaders import DistributedBatchLoader, StreamBatchLoader
from pipeline.data.packing import PackedSequences, PackingIterator, StreamingSequences
from pipeline.data.sources import DataSourceError, default_corpus
from pipeline.data.tokenizer import (ByteTokenizer, Tokenizer, byte_tokenizer, check_same_tokenizer,
                                     load_saved_tokenizer, load_tokenizer)

__all__ = [
    "Tokenizer", "ByteTokenizer", "load_tokenizer", "load_saved_tokenizer", "check_same_tokenizer",
    "byte_tokenizer", "default_corpus", "build_pretraining_data", "main_process_first", "DataSourceError",
    "PackedSequences", "StreamingSequences", "PackingIterator", "DistributedBatchLoader", "StreamBatchLoader",
]
