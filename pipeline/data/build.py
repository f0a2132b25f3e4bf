"""``build_pretraining_data``: sources -> documents -> held-out split -> tokens -> packed sequences."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import datasets
import torch.distributed as dist

from pipeline.data.packing import PackedSequences, StreamingSequences, tokenize_dataset, work_dir
from pipeline.data.sources import DataSourceError, explain_read_error, load_documents, resolve
from pipeline.data.tokenizer import Tokenizer, check_same_tokenizer, load_saved_tokenizer, load_tokenizer
from pipeline.job.errors import InputError, is_rank0

logger = logging.getLogger(__name__)


def build_pretraining_data(data, tokenizer: Tokenizer, seq_length: int, *, text_field: str = "text",
                           valid_fraction: float = 0.01, seed: int = 1234, streaming: bool = False,
                           num_proc: int | None = 1, cache_dir: str | None = None, weights=None,
                           encoding_errors: str = "strict", txt_sample_by: str = "paragraph"):
    """Packed ``(train, valid)`` sequences of ``seq_length + 1`` tokens from ``data``.

    ``data``: None (the default corpus), one spec, comma-separated specs, or a list (see
    :mod:`pipeline.data.sources`). Several sources are concatenated, or mixed by ``weights`` (one per
    source: the probability that the next document comes from it; ``interleave_datasets`` with
    ``all_exhausted``, so smaller sources are repeated).

    Validation holds out documents, never parts of them, deterministically from ``seed``:
    map-style takes ``valid_fraction`` of each source's documents (``train_test_split``); streaming takes
    each document whose seeded content hash falls below ``valid_fraction`` (so the choice does not depend
    on order or sharding). ``valid`` is None when ``valid_fraction == 0``.

    Map-style results are :class:`PackedSequences` (``len``, ``[i]``); streaming ones are
    :class:`StreamingSequences` (iterable; documents in stream order, no shuffle buffer so that resume is
    exact). The map-style build runs first on each node's local rank 0 and then on the other ranks,
    which read its on-disk cache.
    """
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    if encoding_errors not in ("strict", "replace", "ignore"):
        raise ValueError(f"encoding_errors must be 'strict', 'replace' or 'ignore', got {encoding_errors!r}")
    # datasets runs even num_proc=1 in a worker pool (where tokenizers turns its threads off): 1 means in-process
    num_proc = num_proc if num_proc and num_proc > 1 else None
    sources = resolve(data)
    if weights is not None:
        weights = parse_weights(weights, sources)
    load = dict(text_field=text_field, cache_dir=cache_dir, encoding_errors=encoding_errors,
                txt_sample_by=txt_sample_by)
    name = ", ".join(s.spec for s in sources)
    if streaming:
        return _streaming_data(sources, load, tokenizer, seq_length, valid_fraction=valid_fraction, seed=seed,
                               weights=weights)

    with main_process_first():
        trains, valids = [], []
        for source in sources:
            docs = load_documents(source, num_proc=num_proc, **load)
            if len(docs) == 0:
                raise DataSourceError(f"{source.describe()}: no documents")
            if valid_fraction:
                if len(docs) < 2:
                    raise DataSourceError(
                        f"{source.describe()}: only one document, so no validation split can be held out "
                        f"(use valid_fraction=0, split the text into documents, or add data)")
                key = hashlib.sha256(f"{docs._fingerprint}|{valid_fraction}|{seed}".encode()).hexdigest()[:24]
                folder = work_dir(cache_dir)
                split = docs.train_test_split(
                    test_size=valid_fraction, seed=seed, shuffle=True,
                    train_indices_cache_file_name=os.path.join(folder, f"split-{key}-train.arrow"),
                    test_indices_cache_file_name=os.path.join(folder, f"split-{key}-valid.arrow"))
                docs, held_out = split["train"], split["test"]
                valids.append(held_out)
            trains.append(docs)
        train_docs = _combine(trains, weights, seed)
        train = PackedSequences(tokenize_dataset(train_docs, tokenizer, num_proc=num_proc, cache_dir=cache_dir,
                                                 desc="tokenizing train"), seq_length, name=f"train of {name}")
        valid = None
        if valids:
            valid = PackedSequences(tokenize_dataset(_combine(valids, None, seed), tokenizer, num_proc=num_proc,
                                                     cache_dir=cache_dir, desc="tokenizing valid"),
                                    seq_length, name=f"valid of {name}")
    if len(train) == 0:
        raise DataSourceError(f"--data {name}: {train.num_tokens} training tokens, fewer than one sequence of "
                              f"seq_length + 1 = {seq_length + 1} (an empty corpus?)")
    if valid is not None and len(valid) == 0:
        raise DataSourceError(
            f"--data {name}: the validation split (valid_fraction={valid_fraction}) holds {valid.num_tokens} "
            f"tokens, fewer than one sequence of {seq_length + 1}; raise valid_fraction or pass 0")
    logger.info("data: %r, %r", train, valid)
    return train, valid


def parse_weights(weights, sources) -> list[float]:
    """--data-weights: one finite weight >= 0 per source, with a positive sum; normalised to sum to 1."""
    raw = weights.split(",") if isinstance(weights, str) else list(weights)
    try:
        values = [float(w) for w in raw]
    except (TypeError, ValueError):
        values = None
    if values is None or not all(math.isfinite(w) and w >= 0 for w in values) or sum(values) <= 0:
        raise DataSourceError(f"--data-weights {','.join(map(str, raw))}: each weight must be a finite number >= 0 "
                              f"and their sum positive; give one such weight per --data source")
    if len(values) != len(sources):
        raise DataSourceError(f"--data-weights: {len(values)} weights for {len(sources)} data sources "
                              f"({', '.join(s.spec for s in sources)}); give one weight per source")
    return [w / sum(values) for w in values]


def _streaming_data(sources, load: dict, tokenizer: Tokenizer, seq_length: int, *, valid_fraction: float, seed: int,
                    weights):
    name = ", ".join(s.spec for s in sources)
    files = [f for s in sources for f in s.files()]
    docs = [load_documents(s, streaming=True, **load) for s in sources]
    try:  # combining may read the first rows (to resolve features): name the file if that fails
        # The content-hash split is applied after mixing: repeats of a document all land on one side.
        # Filtering Arrow batches keeps the stream in Arrow end to end (no per-document dicts).
        train = _combine(docs, weights, seed)
        if valid_fraction:
            train = train.with_format("arrow").filter(_HashSplit(seed, valid_fraction, False),
                                                      batched=True).with_format(None)
        valid = (_combine(docs, None, seed).with_format("arrow").filter(
            _HashSplit(seed, valid_fraction, True), batched=True).with_format(None) if valid_fraction else None)
    except Exception as e:
        raise explain_read_error(e, files, name) from e
    make = lambda d, part: StreamingSequences(d, tokenizer, seq_length, name=f"{part} of {name}", files=files)
    return make(train, "train"), (make(valid, "valid") if valid is not None else None)


def _combine(parts, weights, seed):
    if len(parts) == 1:
        return parts[0]
    if weights is None:
        return datasets.concatenate_datasets(parts)
    return datasets.interleave_datasets(parts, probabilities=weights, seed=seed, stopping_strategy="all_exhausted")


class _HashSplit:
    """Batched filter: keeps documents whose seeded content hash is below (valid) / above (train) a fraction."""

    def __init__(self, seed: int, fraction: float, keep_valid: bool):
        self.key = str(seed).encode()
        self.threshold = int(fraction * 2**64)
        self.keep_valid = keep_valid

    def __call__(self, batch):
        texts = batch.column("text").to_pylist() if hasattr(batch, "column") else batch
        out = []
        for text in texts:
            h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                                               key=self.key[:64]).digest(), "little")
            out.append((h < self.threshold) == self.keep_valid)
        return out


@contextlib.contextmanager
def main_process_first():
    """Local rank 0 builds (and caches) first; the other ranks then read its cache instead of racing it,
    with their progress bars off (one set of bars per node is enough).

    Rank 0 reaches the barrier even when its build fails, so the others do not hang: they then hit
    the same error themselves.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    bars = datasets.is_progress_bar_enabled()
    if not first:
        datasets.disable_progress_bars()
        dist.barrier()
    try:
        yield
    finally:
        if first:
            dist.barrier()
        elif bars:
            datasets.enable_progress_bars()


def tokenizer_for_bare_model(load_dir: Path, spec: str | None, *, corpus=None) -> Tokenizer:
    """The tokenizer of a model saved without one (``pipeline.import_hf`` of a directory holding no tokenizer
    files): ``spec``, when its ids fit the model's embedding (a smaller vocabulary leaves the last rows unused, as
    a padded vocabulary does; said in one line), else one line saying which tokenizer to pass."""
    config = load_dir / "config.json"
    model_vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    if spec is None:
        raise InputError(f"--load {load_dir}: the model has no tokenizer (no tokenizer.json beside {config.name}); "
                         f"pass --tokenizer DIR, its tokenizer's directory (vocabulary of {model_vocab} tokens), or "
                         f"import a model directory that holds its tokenizer files")
    with main_process_first():
        tokenizer = load_tokenizer(spec, corpus=corpus)
    if model_vocab is not None and tokenizer.vocab_size > model_vocab:
        raise InputError(f"--tokenizer {spec}: {tokenizer.vocab_size} tokens, but the model in {load_dir} has "
                         f"vocab_size {model_vocab} (it has no tokenizer of its own); pass the tokenizer it was "
                         f"trained with, of at most {model_vocab} tokens")
    if model_vocab is not None and tokenizer.vocab_size < model_vocab and is_rank0():
        print(f"note: --tokenizer {spec} has {tokenizer.vocab_size} tokens for the {model_vocab} embedding rows of "
              f"{load_dir}: rows {tokenizer.vocab_size}-{model_vocab - 1} are unused", flush=True)
    return tokenizer


def run_tokenizer(load_dir: Path | None, spec: str | None, default: str, *, corpus=None,
                  vocab_size: int | None = None) -> Tokenizer:
    """A training run's tokenizer: the one saved with ``load_dir`` (a resumed run keeps it), else ``spec`` (or
    the family's ``default``) built on rank 0 first; a ``spec`` given with ``load_dir`` must match the saved one."""
    saved = None
    if load_dir is not None:
        saved = load_dir / "tokenizer" if (load_dir / "tokenizer").is_dir() else load_dir
    if saved is not None and not (saved / "tokenizer.json").is_file():
        return tokenizer_for_bare_model(load_dir, spec, corpus=corpus)
    if saved is not None and spec is None:
        return load_saved_tokenizer(saved)
    with main_process_first():
        tokenizer = load_tokenizer(spec or default, corpus=corpus, vocab_size=vocab_size)
    if saved is not None:
        check_same_tokenizer(saved, tokenizer)
    return tokenizer
