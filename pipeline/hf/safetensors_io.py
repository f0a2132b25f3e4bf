"""Safetensors files read and written one tensor at a time, so that a model is never held twice in memory.

    weights = SafetensorsFiles([path, ...])     # a read-only mapping; ``weights.shape_of(name)`` reads no data
    write_safetensors(path, {name: tensor or PlannedTensor(shape, dtype, make)})
    write_hf_weights(directory, tensors)        # model.safetensors, or shards + model.safetensors.index.json

The ``safetensors`` package memory-maps its files, and every page a conversion touches stays resident until the
file is closed: converting a 4 GB file that way costs 4 GB of resident memory on top of the output. Here a tensor
is read with plain file reads into a tensor the caller owns, and written from a producer called only when its
turn comes, so the peak is what the caller holds plus one tensor. The format is the published one (a little-endian
u64 header length, a JSON header of dtype, shape and data offsets, then the bytes): the files are read back by the
``safetensors`` package and ``transformers`` unchanged.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from pipeline.job.errors import UserError

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
               torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_HEADER_BYTES = 100 * 2 ** 20  # the safetensors package's own limit
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
HF_MAX_SHARD_BYTES = 5 * 10 ** 9  # huggingface_hub's default shard size


class SafetensorsError(UserError, ValueError):
    """A file that is not a well-formed safetensors file (names the file and what is wrong)."""


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written, known by its shape and dtype until ``make()`` produces it (at its turn)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def shape_and_dtype(value) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(value.shape), value.dtype


def materialize(value) -> torch.Tensor:
    return value.make() if isinstance(value, PlannedTensor) else value


# -- reading -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    path: Path
    offset: int           # absolute byte offset in the file
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_header(path: str | Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """({name: entry}, metadata) of one safetensors file, every offset checked against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"weights file {path} is not a readable safetensors file: shorter than its "
                                   f"header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"weights file {path} is not a readable safetensors file: header of {n} bytes "
                                   f"in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"weights file {path} is not a readable safetensors file: bad header "
                                   f"({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"weights file {path} is not a readable safetensors file: the header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    base, entries = 8 + n, {}
    for name, info in header.items():
        try:
            dtype = CODE_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"weights file {path} is not a readable safetensors file: bad entry for "
                                   f"{name!r}: {info!r}") from None
        nbytes = prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes or base + end > size:
            raise SafetensorsError(f"weights file {path} is not a readable safetensors file: {name} "
                                   f"(shape {list(shape)}, {info['dtype']}) at bytes {begin}..{end} does not fit "
                                   f"a file of {size} bytes (truncated?)")
        entries[name] = _Entry(path, base + begin, nbytes, shape, dtype)
    return entries, metadata


class SafetensorsFiles(Mapping):
    """A read-only mapping over one or several safetensors files; each lookup reads that tensor from disk
    into memory the caller owns (nothing memory-mapped, nothing cached)."""

    def __init__(self, paths: Iterable[str | Path]):
        self.paths = [Path(p) for p in paths]
        self._entries: dict[str, _Entry] = {}
        self.metadata: dict[str, str] = {}
        for path in self.paths:
            entries, metadata = read_header(path)
            twice = sorted(set(entries) & set(self._entries))
            if twice:
                raise SafetensorsError(f"{twice[0]} is in both {self._entries[twice[0]].path} and {path}")
            self._entries.update(entries)
            self.metadata.update(metadata)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype_of(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            with open(e.path, "rb", buffering=0) as f:
                f.seek(e.offset)
                done = 0
                while done < e.nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise SafetensorsError(f"weights file {e.path} ended inside {name}")
                    done += got
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries


def shape_of(tensors: Mapping, name: str) -> tuple[int, ...]:
    """The shape of ``tensors[name]`` without reading it where the mapping can say (SafetensorsFiles)."""
    get = getattr(tensors, "shape_of", None)
    return tuple(get(name)) if get is not None else tuple(tensors[name].shape)


def dtype_of(tensors: Mapping, name: str) -> torch.dtype:
    """The dtype of ``tensors[name]`` without reading it where the mapping can say (SafetensorsFiles)."""
    get = getattr(tensors, "dtype_of", None)
    return get(name) if get is not None else tensors[name].dtype


def reports_shapes(tensors: Mapping) -> bool:
    """Whether ``tensors`` is a lazy mapping that knows its tensors' shapes without reading them."""
    return callable(getattr(tensors, "shape_of", None))


def hf_weight_files(directory: str | Path) -> list[Path] | None:
    """The safetensors files of a Hugging Face model directory (sharded or not), or None when it has none."""
    directory = Path(directory)
    index = directory / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index} is not a safetensors index (no weight_map): {e}") from None
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if Path(n).name != n]
        if bad:
            raise SafetensorsError(f"{index} names a file outside its directory: {bad[0]!r}")
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise SafetensorsError(f"{index} names {missing[0]}, which is not in {directory}")
        return [directory / n for n in names]
    single = directory / HF_WEIGHTS
    return [single] if single.is_file() else None


# -- writing -------------------------------------------------------------------------------------------------------

def write_safetensors(path: str | Path, tensors: Mapping, metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` ({name: tensor or PlannedTensor}) to ``path``, one at a time; returns the bytes written.

    Tensors may share storage (views of one weight are written as separate tensors). A produced tensor must
    have the shape and dtype it was planned with.
    """
    header, offset = {}, 0
    for name, value in tensors.items():
        shape, dtype = shape_and_dtype(value)
        if dtype not in DTYPE_CODES:
            raise SafetensorsError(f"{name}: dtype {dtype} has no safetensors code")
        nbytes = prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, value in tensors.items():
            t = materialize(value).detach()
            if shape_and_dtype(t) != shape_and_dtype(value):
                raise SafetensorsError(f"{name}: produced {list(t.shape)} {t.dtype}, planned "
                                       f"{list(value.shape)} {value.dtype}")
            t = t.to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            del t
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def write_hf_weights(directory: str | Path, tensors: Mapping, *, max_shard_bytes: int = HF_MAX_SHARD_BYTES,
                     metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Hugging Face's layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (a bigger tensor gets a shard of its own) and ``model.safetensors.index.json``."""
    directory = Path(directory)
    shards: list[dict] = [{}]
    size = 0
    for name, value in tensors.items():
        shape, dtype = shape_and_dtype(value)
        nbytes = prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        write_safetensors(directory / HF_WEIGHTS, shards[0], meta)
        return [directory / HF_WEIGHTS]
    n, paths, weight_map = len(shards), [], {}
    for i, shard in enumerate(shards, 1):
        path = directory / f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(path, shard, meta)
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    index = {"metadata": {"total_size": sum(prod(shape_and_dtype(v)[0]) * shape_and_dtype(v)[1].itemsize
                                            for v in tensors.values())},
             "weight_map": weight_map}
    (directory / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return paths
