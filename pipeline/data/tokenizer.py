"""Tokenizers for pretraining: GPT-2 byte-level BPE, any ``tokenizer.json``, a BPE trained on the corpus,
and a byte-level character tokenizer for the mLSTM.

Every kind is one :class:`Tokenizer` around a Hugging Face ``tokenizers.Tokenizer``, so all of them save
as ``tokenizer.json`` + ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` loads, and all of
them share one fingerprint rule (a hash of the canonical ``tokenizer.json`` plus the end-of-document id).

Special tokens written literally inside training text (e.g. a document quoting ``<|endoftext|>``) are
encoded as ordinary text: only real document boundaries become ``eod_id`` (``encode_special_tokens``).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path
from typing import Iterable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pipeline.job.errors import InputError
from pipeline.job.files import atomic_write_text

from pipeline.data.sources import iter_texts

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CONFIG_KEY = "pipeline_tokenizer"  # our own metadata inside tokenizer_config.json
# End-of-text markers of common tokenizer.json files, tried in order when no config names one.
_KNOWN_EOD = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class Tokenizer:
    """A text <-> ids codec with an end-of-document id, backed by ``tokenizers``.

    ``name`` says where it came from ("gpt2-bpe", "bytes", "bpe-trained", "tokenizer-json");
    ids are in ``[0, vocab_size)``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, name: str, eod_token: str, pad_token: str | None = None):
        eod_id = backend.token_to_id(eod_token)
        if eod_id is None:
            raise ValueError(f"tokenizer {name!r} has no end-of-document token {eod_token!r} in its vocabulary")
        self._backend = backend
        self._backend.encode_special_tokens = True
        self.name = name
        self.eod_token = eod_token
        self.eod_id = int(eod_id)
        self.pad_token = pad_token
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self._fingerprint: str | None = None

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        # tokenizers pickles the tokenizer.json only: re-apply the runtime flag in worker processes
        self.__dict__.update(state)
        self._backend.encode_special_tokens = True

    # --- codec -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_documents(self, texts: list[str], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        """Token stream of ``texts``, each followed by ``eod_id`` (empty texts dropped), and the per-document
        lengths (eod included): the packing hot path, one numpy array instead of lists."""
        texts = [t for t in texts if t]
        ids = self.encode_batch(texts) if texts else []
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable((*x, self.eod_id) for x in ids), dtype=dtype,
                           count=int(lengths.sum()))
        return flat, lengths

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._backend.decode(list(ids), skip_special_tokens=False)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. for a bare-encoder baseline)."""
        return self._backend

    # --- identity ----------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of the tokenizer.json text and the eod id: equal iff the tokenizers encode alike.

        ``to_str()`` is canonical (fixed field order, vocabulary in id order), so no re-serialization.
        """
        if self._fingerprint is None:
            digest = hashlib.sha256(self._backend.to_str().encode("utf-8"))
            digest.update(f"|eod={self.eod_id}".encode())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, "
                f"fingerprint={self.fingerprint()[:12]})")

    # --- persistence -------------------------------------------------------------------------------
    def save(self, directory) -> None:
        """Write tokenizer.json + tokenizer_config.json (atomically): loads with
        :func:`load_saved_tokenizer` and with ``transformers.AutoTokenizer.from_pretrained``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.eod_token,
            "eos_token": self.eod_token,
            "unk_token": self.eod_token if self.name == "gpt2-bpe" else None,
            "pad_token": self.pad_token,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(1e30),
            CONFIG_KEY: {"name": self.name, "eod_token": self.eod_token, "pad_token": self.pad_token,
                         "vocab_size": self.vocab_size, "fingerprint": self.fingerprint()},
        }
        config = {k: v for k, v in config.items() if v is not None}
        atomic_write_text(directory / "tokenizer.json", self._backend.to_str(pretty=True))
        atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then ``<|endoftext|>`` (256) and ``<|pad|>`` (257).

    The backend is a merge-free byte-level BPE (so tokenizer.json / AutoTokenizer work); encoding takes
    a direct path, which the tests check equals the backend.
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_documents(self, texts: list[str], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8") for t in texts if t]
        lengths = np.fromiter((len(b) + 1 for b in encoded), dtype=np.int64, count=len(encoded))
        flat = np.empty(int(lengths.sum()), dtype=dtype)
        ends = np.cumsum(lengths)
        body = np.ones(len(flat), dtype=bool)
        body[ends - 1] = False
        flat[body] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        flat[ends - 1] = self.eod_id
        return flat, lengths


def byte_tokenizer() -> ByteTokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; give that char id b.
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOD_TOKEN, PAD_TOKEN])
    return ByteTokenizer(backend, "bytes", EOD_TOKEN, PAD_TOKEN)


def gpt2_bpe(directory) -> Tokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (the same pipeline as HF GPT2Tokenizer)."""
    directory = Path(directory)
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    try:
        model = models.BPE.from_file(str(vocab), str(merges), fuse_unk=False)
    except Exception as e:  # tokenizers' message lacks the file names
        raise ValueError(f"cannot read a BPE from {vocab} and {merges}: {e}") from e
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if backend.token_to_id(EOD_TOKEN) is None:
        raise ValueError(f"{vocab} has no {EOD_TOKEN!r} entry; is it a GPT-2 vocabulary?")
    backend.add_special_tokens([EOD_TOKEN])
    return Tokenizer(backend, "gpt2-bpe", EOD_TOKEN)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included) on ``texts``."""
    if vocab_size is None:
        raise ValueError("load_tokenizer('train-bpe') needs vocab_size=")
    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes + {EOD_TOKEN}), got {vocab_size}")
    backend = tokenizers.Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    seen = [0]

    def counted():
        for t in texts:
            if t:
                seen[0] += 1
                yield t
    backend.train_from_iterator(counted(), trainer=trainer)
    if seen[0] == 0:
        raise ValueError("cannot train a BPE tokenizer on an empty corpus (no non-empty documents)")
    return Tokenizer(backend, "bpe-trained", EOD_TOKEN)


def from_tokenizer_json(path) -> Tokenizer:
    """Any ``tokenizer.json``; name and end-of-document token come from a sibling tokenizer_config.json
    (ours, or transformers' ``eos_token``), else from the usual end-of-text tokens."""
    path = Path(path)
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"cannot read tokenizer file {path}: {e}") from e
    name, eod, pad = "tokenizer-json", None, None
    config_path = path.parent / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        ours = config.get(CONFIG_KEY) or {}
        name = ours.get("name", name)
        eod = ours.get("eod_token") or _token_content(config.get("eos_token"))
        pad = ours.get("pad_token") or _token_content(config.get("pad_token"))
    if eod is None:
        eod = next((t for t in _KNOWN_EOD if backend.token_to_id(t) is not None), None)
    if eod is None:
        raise ValueError(f"{path}: no end-of-document token found (looked for eos_token in {config_path.name} "
                         f"and for {', '.join(_KNOWN_EOD)}); documents cannot be joined without one")
    cls = ByteTokenizer if name == "bytes" else Tokenizer
    return cls(backend, name, eod, pad)


def load_tokenizer(spec: str, *, corpus=None, vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer from ``spec``:

    - ``"bytes"``: 256 UTF-8 bytes + ``<|endoftext|>`` + ``<|pad|>`` (char-level mLSTM);
    - a directory with ``vocab.json`` + ``merges.txt``: GPT-2 byte-level BPE;
    - a ``tokenizer.json`` file or a directory containing one (e.g. a saved checkpoint tokenizer);
    - ``"train-bpe"``: a byte-level BPE of ``vocab_size`` trained on ``corpus`` (texts, or a data spec as
      for :func:`build_pretraining_data`, or None for the default corpus).
    """
    spec = str(spec)
    if spec == "bytes":
        return byte_tokenizer()
    if spec == "train-bpe":
        return train_bpe(iter_texts(corpus), vocab_size)
    path = Path(spec).expanduser()
    if path.is_file():
        return from_tokenizer_json(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return from_tokenizer_json(path / "tokenizer.json")
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return gpt2_bpe(path)
        found = sorted(p.name for p in path.iterdir())[:10]
        raise FileNotFoundError(f"tokenizer directory {path} has neither tokenizer.json nor vocab.json + "
                                f"merges.txt (it has: {', '.join(found) or 'nothing'})")
    raise FileNotFoundError(
        f"unknown tokenizer {spec!r}: expected 'bytes', 'train-bpe', a tokenizer.json file, or a directory "
        f"with tokenizer.json or vocab.json + merges.txt (no such file or directory: {path})")


def load_saved_tokenizer(directory) -> Tokenizer:
    """The tokenizer :meth:`Tokenizer.save` wrote into ``directory``."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no saved tokenizer in {directory} (missing {path.name})")
    return from_tokenizer_json(path)


def check_same_tokenizer(saved_dir, tokenizer: Tokenizer) -> None:
    """Refuse to resume or evaluate a checkpoint with a tokenizer other than the one it was trained with."""
    saved = load_saved_tokenizer(saved_dir)
    if saved.fingerprint() != tokenizer.fingerprint():
        raise InputError(
            f"tokenizer mismatch: {saved_dir} was trained with tokenizer {saved.name!r} (vocab_size "
            f"{saved.vocab_size}, eod_id {saved.eod_id}, fingerprint {saved.fingerprint()[:12]}) but this run "
            f"uses {tokenizer.name!r} (vocab_size {tokenizer.vocab_size}, eod_id {tokenizer.eod_id}, fingerprint "
            f"{tokenizer.fingerprint()[:12]}); pass the checkpoint's tokenizer (--tokenizer {saved_dir})")


def _token_content(token):
    if isinstance(token, dict):
        return token.get("content")
    return token


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table (the one ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
