"""The data arguments of the pretraining job (its "data" group): corpora, mixture weights, tokenizer, split."""
from __future__ import annotations

from pipeline.job.numbers import int_in, probability


def add_data_args(p) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", default=None,
                   help="a corpus: files, folders, globs, save_to_disk dirs, hub names; repeat or comma-separate "
                        "to concatenate (default: the Python standard library's source, real text on every machine)")
    g.add_argument("--data-weights", help="comma-separated mixture weights, one per --data source")
    g.add_argument("--data-encoding-errors", choices=["strict", "replace", "ignore"], default="strict",
                   help="bytes that are not UTF-8: refuse the file (strict, default), or read them as U+FFFD "
                        "(replace) or drop them (ignore)")
    g.add_argument("--text-field", default="text")
    g.add_argument("--streaming", action="store_true")
    g.add_argument("--tokenizer", default=None,
                   help="'bytes', 'train-bpe', a tokenizer.json, or a directory with vocab.json + merges.txt "
                        "(default: the checkpoint's when resuming, else train-bpe)")
    g.add_argument("--vocab-size", type=int_in(1, 2**24), default=4096, help="vocabulary of --tokenizer train-bpe")
    g.add_argument("--valid-fraction", type=probability(open_high=True), default=0.01)
    g.add_argument("--num-proc", type=int_in(1, 1024), default=1, help="processes for tokenization")
    g.add_argument("--cache-dir", default=None, help="datasets cache directory")
