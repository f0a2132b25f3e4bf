"""Pretraining data flow: any corpus -> tokenized -> packed -> sharded over DP ranks -> resumable batches.

    tok = load_tokenizer("path/to/gpt2")          # or "bytes", "train-bpe", a tokenizer.json
    train, valid = build_pretraining_data("corpus/*.txt", tok, seq_length=1024)
    loader = DistributedBatchLoader(train, micro_batch_size=8, dp_rank=r, dp_world_size=w)
    batch = next(loader)["tokens"]                 # LongTensor [8, 1025]
    state = loader.state_dict()                    # into the checkpoint; load_state_dict to resume
"""
from .build import build_pretraining_data, main_process_first
from .loaders import DistributedBatchLoader, StreamBatchLoader
from .packing import PackedSequences, PackingIterator, StreamingSequences
from .sources import DataSourceError, default_corpus
from .tokenizer import (ByteTokenizer, Tokenizer, byte_tokenizer, check_same_tokenizer, load_saved_tokenizer,
                        load_tokenizer)

__all__ = [
    "Tokenizer", "ByteTokenizer", "load_tokenizer", "load_saved_tokenizer", "check_same_tokenizer",
    "byte_tokenizer", "default_corpus", "build_pretraining_data", "main_process_first", "DataSourceError",
    "PackedSequences", "StreamingSequences", "PackingIterator", "DistributedBatchLoader", "StreamBatchLoader",
]
