"""Where documents come from: one ``--data`` value (or several) resolved to a ``datasets`` dataset whose
single column ``text`` holds one document per row.

Accepted forms (comma-separated or a list for several):

- local files ``.txt`` (a document is a blank-line separated paragraph; ``txt_sample_by`` changes it),
  ``.json``/``.jsonl``/``.ndjson`` (``text_field``), ``.csv``/``.tsv`` (header row; TSV is unquoted),
  ``.parquet``; each optionally compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``);
- a folder (searched recursively for those files) or a glob (``data/**/*.jsonl``);
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (its ``train`` split);
- a hub dataset ``name[:config][:split]`` (default split ``train``). With ``HF_HUB_OFFLINE`` /
  ``HF_DATASETS_OFFLINE`` set only the local datasets cache is read, and a miss fails at once.

Undecodable bytes: by default (``encoding_errors="strict"``) a file that is not valid UTF-8 is refused with
its name, byte offset and line; ``encoding_errors="replace"`` substitutes U+FFFD instead (text/json/csv).
Empty (0-byte) files are skipped with a warning; a source with no documents at all is an error.
"""
from __future__ import annotations

import bz2
import codecs
import csv
import glob as globlib
import gzip
import json
import logging
import lzma
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from pipeline.job.errors import UserError

logger = logging.getLogger(__name__)


class DataSourceError(UserError, ValueError):
    """Bad ``--data`` input: the message names the source, file, field or byte at fault."""


_COMPRESSION = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}
_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".ndjson": "json",
            ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


@dataclass
class Part:
    """Files of one format inside a source, loaded with one builder call."""
    fmt: str                      # text | json | csv | tsv | parquet
    files: list[str]


@dataclass
class Source:
    spec: str                     # as the user wrote it
    kind: str                     # files | disk | hub | default
    parts: list[Part] = field(default_factory=list)
    path: str | None = None       # save_to_disk directory
    hub: tuple | None = None      # (name, config, split)

    def files(self) -> list[str]:
        return [f for p in self.parts for f in p.files]

    def describe(self) -> str:
        files = self.files()
        if len(files) == 1:
            return files[0]
        if files:
            return f"{self.spec} ({len(files)} files: {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
        return self.spec


def default_corpus() -> list[str]:
    """Real text present on every machine without a download: the running Python's standard-library
    sources (``sysconfig`` stdlib ``*.py``, test suites and site-packages left out), sorted paths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if skip.isdisjoint(rel) and path.stat().st_size > 0:
            files.append(str(path))
    if not files:
        raise DataSourceError(f"the default corpus is empty: no *.py files under {root} (a Python without its "
                              f"standard-library sources?); pass --data")
    return files


def split_specs(data) -> list[str]:
    if data is None:
        return []
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    specs = []
    for item in items:
        specs.extend(s.strip() for s in str(item).split(",") if s.strip())
    if not specs:
        raise DataSourceError(f"no data source given in {data!r}")
    return specs


def resolve(data) -> list[Source]:
    """Turn ``data`` (None, a spec, comma-separated specs, or a list) into checked sources."""
    if data is None:
        return [Source("<default corpus: Python standard library sources>", "default",
                       [Part("text-document", default_corpus())])]
    return [_resolve_one(spec) for spec in split_specs(data)]


def _resolve_one(spec: str) -> Source:
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        matches = sorted(p for p in globlib.glob(str(path), recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"--data {spec!r}: the glob matches no files")
        return Source(spec, "files", _group(matches, spec))
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return Source(spec, "disk", path=str(path))
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and _fmt(p) and
                       not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))
        if not files:
            found = sorted(p.name for p in path.iterdir())[:10]
            raise DataSourceError(
                f"--data {spec!r}: folder has no data files ({', '.join(sorted(_FORMATS))}, optionally "
                f"compressed) and is not a save_to_disk directory; it contains: {', '.join(found) or 'nothing'}")
        return Source(spec, "files", _group(files, spec))
    if path.is_file():
        return Source(spec, "files", _group([str(path)], spec))
    name, _, rest = spec.partition(":")
    if _HUB_NAME.match(name) and not _fmt(Path(name)) and not spec.startswith((".", "/", "~")):
        config, _, split = rest.partition(":")
        return Source(spec, "hub", hub=(name, config or None, split or "train"))
    raise FileNotFoundError(f"--data {spec!r}: no such file or directory")


def _fmt(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return _FORMATS.get(suffixes[-1]) if suffixes else None


def _group(files: list[str], spec: str) -> list[Part]:
    parts: dict[str, list[str]] = {}
    empty = []
    for f in files:
        fmt = _fmt(Path(f))
        if fmt is None:
            raise DataSourceError(f"{f}: unsupported file type (expected {', '.join(sorted(_FORMATS))}, "
                                  f"optionally with {', '.join(_COMPRESSION)})")
        if os.path.getsize(f) == 0:
            empty.append(f)
            continue
        parts.setdefault(fmt, []).append(f)
    if empty:
        if not parts:
            raise DataSourceError(f"--data {spec!r}: every file is empty: {', '.join(empty[:5])}")
        logger.warning("skipping %d empty file(s) in %s: %s", len(empty), spec, ", ".join(empty[:5]))
    return [Part(fmt, fs) for fmt, fs in parts.items()]


# --- loading ------------------------------------------------------------------------------------------

def load_documents(source: Source, *, text_field: str = "text", streaming: bool = False,
                   cache_dir: str | None = None, encoding_errors: str = "strict",
                   txt_sample_by: str = "paragraph", num_proc: int | None = None):
    """The source as a ``Dataset`` (or ``IterableDataset`` when streaming) with one string column ``text``."""
    if source.kind in ("files", "default"):
        for part in source.parts:
            check_text_field(part, text_field)
        loaded = [_load_part(source, part, text_field, streaming, cache_dir, encoding_errors, txt_sample_by,
                             num_proc) for part in source.parts]
        if len(loaded) == 1:
            return loaded[0]
        return datasets.concatenate_datasets(loaded)
    if source.kind == "disk":
        ds = datasets.load_from_disk(source.path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" in ds:
                ds = ds["train"]
            elif len(ds) == 1:
                ds = next(iter(ds.values()))
            else:
                raise DataSourceError(f"{source.path}: a DatasetDict without a 'train' split (splits: "
                                      f"{', '.join(ds)}); save the split you want to pretrain on")
        ds = _text_only(ds, text_field, source.path)
        return ds.to_iterable_dataset(num_shards=max(1, min(64, len(ds) // 1000))) if streaming else ds
    return _load_hub(source, text_field, streaming, cache_dir, num_proc)


def _load_part(source, part, text_field, streaming, cache_dir, encoding_errors, txt_sample_by, num_proc):
    fmt, kwargs = part.fmt, {}
    if fmt in ("text", "text-document"):
        builder = "text"
        # 1 MiB reads (datasets' default is 10 MiB): a read becomes a str of up to 4 bytes per character
        # and then a list of documents, so the chunk size sets the transient memory of streaming
        kwargs = dict(sample_by="document" if fmt == "text-document" else txt_sample_by,
                      encoding_errors=encoding_errors, chunksize=1 << 20)
    elif fmt == "json":
        builder, kwargs = "json", dict(encoding_errors=encoding_errors, chunksize=1 << 20)
    elif fmt in ("csv", "tsv"):
        builder = "csv"
        kwargs = dict(encoding_errors=encoding_errors)
        if fmt == "tsv":
            kwargs.update(sep="\t", quoting=csv.QUOTE_NONE)
    else:
        builder = "parquet"
    where = source.describe() if len(source.parts) == 1 else f"{source.spec} ({fmt} files)"
    try:
        if streaming:
            ds = datasets.load_dataset(builder, data_files=part.files, split="train", streaming=True,
                                       cache_dir=cache_dir, **kwargs)
        else:
            ds = _load_local_files(builder, part.files, cache_dir, num_proc, **kwargs)
    except Exception as e:
        raise explain_read_error(e, part.files, where) from e
    field_name = "text" if builder == "text" else text_field
    return _text_only(ds, field_name, where)


class _FilesWhereTheyLie(datasets.DownloadManager):
    """A download manager for local data files: they are read where they lie (as datasets' own manager returns a
    local path unchanged), without its "Downloading data: N/N files" bar, which it shows for 16 files or more
    although nothing is downloaded. Compressed files are still extracted by the manager's ``extract``."""

    def download(self, url_or_urls):
        return url_or_urls


def _load_local_files(builder_name: str, files, cache_dir, num_proc, **kwargs) -> datasets.Dataset:
    """``datasets.load_dataset(builder_name, data_files=files, split="train")``: the same builder, cache and
    "Generating train split" progress, with the local files read in place."""
    builder = datasets.load_dataset_builder(builder_name, data_files=files, cache_dir=cache_dir, **kwargs)
    downloads = None if cache_dir is None else os.path.join(cache_dir, "downloads")  # where datasets extracts
    manager = _FilesWhereTheyLie(dataset_name=builder.dataset_name, data_dir=builder.config.data_dir,
                                 download_config=datasets.DownloadConfig(cache_dir=downloads, num_proc=num_proc))
    builder.download_and_prepare(dl_manager=manager, num_proc=num_proc)
    return builder.as_dataset(split="train")


def _hub_offline() -> bool:
    env = any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return env or bool(datasets.config.HF_HUB_OFFLINE)


def _load_hub(source, text_field, streaming, cache_dir, num_proc):
    name, config, split = source.hub
    offline = _hub_offline()
    not_local = f"there is no local file or directory {source.spec!r}, so it was taken as a hub dataset"
    if offline and not datasets.config.HF_HUB_OFFLINE:
        # The env var was set after `datasets` was imported: it would still try the network. Refuse now.
        raise DataSourceError(f"--data {source.spec!r}: {not_local}, but the hub is offline "
                              f"(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); use a local path or save_to_disk directory")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming, cache_dir=cache_dir,
                                   num_proc=None if streaming else num_proc)
    except Exception as e:
        if offline:
            raise DataSourceError(
                f"--data {source.spec!r}: {not_local} (name {name!r}, config {config!r}, split {split!r}), but "
                f"the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE) and the datasets cache does not hold "
                f"it; download it once online, or give a local path or save_to_disk directory") from e
        raise DataSourceError(f"--data {source.spec!r}: could not load hub dataset {name!r} (config {config!r}, "
                              f"split {split!r}): {_root_cause(e)}") from e
    return _text_only(ds, text_field, f"hub dataset {source.spec}")


def _text_only(ds, text_field: str, where: str):
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataSourceError(f"{where}: no text field {text_field!r}; its columns are {columns} "
                              f"(choose one with text_field= / --text-field)")
    features = ds.features
    if features is not None and text_field in features:
        feature = features[text_field]
        dtype = getattr(feature, "dtype", None)
        if dtype not in ("string", "large_string"):
            raise DataSourceError(f"{where}: {_first_non_text(ds, text_field)}; make every record's "
                                  f"{text_field!r} a string (or choose another field with --text-field)")
    _refuse_null_text(ds, text_field, where)
    ds = ds.select_columns([text_field])
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    if features is not None and features[text_field].dtype == "large_string":
        ds = ds.cast_column("text", datasets.Value("string"))
    return ds


def _first_non_text(ds, text_field: str) -> str:
    """What the field holds, and which record first (a loaded dataset; a stream is named by its type only)."""
    feature = ds.features[text_field]
    kind = f"{getattr(feature, 'dtype', None) or type(feature).__name__} values"
    if isinstance(ds, datasets.Dataset):
        for i, value in enumerate(ds[text_field]):
            if not isinstance(value, str):
                return (f"field {text_field!r} holds {kind}, not text: record {i + 1} is {type(value).__name__} "
                        f"{str(value)[:40]!r}")
    return f"field {text_field!r} holds {kind}, not text"


def _bad_json_line(files) -> str | None:
    """The first line of a JSON-lines file that is not one JSON value, as 'FILE: line N: ...'."""
    for path in files:
        f = _open(path)
        if f is None:
            continue
        with f:
            if f.read(1 << 16).lstrip()[:1] != b"{":
                continue  # one JSON document (an array): datasets' own message stands
            f.seek(0)
            for n, raw in enumerate(f, 1):
                try:
                    if raw.strip():
                        json.loads(raw)
                except ValueError as e:
                    return (f"{path}: line {n}: not one JSON record ({e}); JSON-lines files hold one object a "
                            f"line: fix or remove the line")
    return None


def _refuse_null_text(ds, text_field: str, where: str) -> None:
    """A record whose text is null (JSON ``null``, an empty parquet cell) is refused, not read as no text.
    Loaded datasets are Arrow tables: the null count is free; a stream's records are checked as they come."""
    if not isinstance(ds, datasets.Dataset):
        return
    column = ds.data.column(text_field)
    if column.null_count:
        # pyarrow's compute/parquet modules only for those sources
        import pyarrow.compute as pc  # noqa: PLC0415
        row = pc.index(pc.is_null(column), True).as_py()
        raise DataSourceError(f"{where}: record {row + 1} has a null {text_field!r} field ({column.null_count} "
                              f"record(s) in all); give each record a text or drop those records")


def _open(path: str, mode: str = "rb"):
    opener = _COMPRESSION.get(Path(path).suffix.lower())
    if opener is None and Path(path).suffix.lower() in _COMPRESSION:
        return None  # no stdlib reader for this compression: skip the pre-check
    return (opener or open)(path, mode)


def check_text_field(part: Part, text_field: str) -> None:
    """Cheap up-front check (first record / header / schema of each file) that ``text_field`` exists,
    so a typo fails at once naming the file and its columns rather than deep inside a builder."""
    for path in part.files:
        columns = None
        if part.fmt == "parquet":
            # pyarrow's compute/parquet modules only for those sources
            import pyarrow.parquet as pq  # noqa: PLC0415
            try:
                columns = pq.read_schema(path).names
            except Exception as e:
                raise DataSourceError(f"{path}: not a readable parquet file: {e}") from e
        elif part.fmt in ("csv", "tsv"):
            f = _open(path)
            if f is None:
                continue
            with f:
                header = f.readline().decode("utf-8-sig", errors="replace").rstrip("\r\n")
            columns = next(csv.reader([header], delimiter="\t" if part.fmt == "tsv" else ","), [])
        elif part.fmt == "json":
            f = _open(path)
            if f is None:
                continue
            with f:
                head = f.read(1 << 16).decode("utf-8", errors="replace").lstrip()
            if not head.startswith("{"):
                continue  # a JSON array or other layout: checked after loading
            line = head.split("\n", 1)[0]
            try:
                record = json.loads(line)
            except ValueError:
                continue  # one pretty-printed object: checked after loading
            if isinstance(record, dict):
                columns = list(record)
        if columns is not None and text_field not in columns:
            raise DataSourceError(f"{path}: no text field {text_field!r}; its columns are {columns} "
                                  f"(choose one with text_field= / --text-field)")


def find_bad_utf8(files) -> str | None:
    """The first invalid UTF-8 byte among ``files``, as 'FILE: ... at byte N (line L)'; None if all decode."""
    for path in files:
        f = _open(path)
        if f is None:
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, line = 0, 1
        with f:
            while True:
                chunk = f.read(1 << 20)
                final = not chunk
                try:
                    decoder.decode(chunk, final=final)
                except UnicodeDecodeError as e:
                    # e.start indexes the decoder's pending bytes + chunk; pending bytes are < 4
                    pending = len(e.object) - len(chunk)
                    pos = offset - pending + e.start
                    line += e.object[:e.start].count(b"\n")
                    bad = e.object[e.start:e.start + 4]
                    return (f"{path}: not valid UTF-8 at byte {pos} (line {line}, bytes {bad!r}); fix or re-encode "
                            f"the file, or pass encoding_errors='replace' (--data-encoding-errors replace) to read "
                            f"such bytes as U+FFFD")
                if final:
                    break
                line += chunk.count(b"\n")
                offset += len(chunk)
    return None


def explain_read_error(error: BaseException, files, where: str) -> Exception:
    """A clear error for a failure while reading ``files``: bad UTF-8 located exactly, else the root cause."""
    if isinstance(error, (DataSourceError, FileNotFoundError)):
        return error
    bad = find_bad_utf8(files) or (_bad_json_line(files) if "Trailing data" in _root_cause(error)
                                   or "JSON" in _root_cause(error) else None)
    if bad is not None:
        return DataSourceError(bad)
    if "corresponds to no data" in _root_cause(error):  # datasets' words for a split with 0 rows
        return DataSourceError(f"{where}: no documents")
    return DataSourceError(f"could not read {where}: {_root_cause(error)}")


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}"


def iter_texts(corpus, batch_size: int = 1000):
    """Texts of ``corpus`` for tokenizer training: an iterable of strings, a data spec (or list of paths),
    or None for the default corpus. Sources are streamed, so nothing is cached or held in memory."""
    if corpus is not None and not isinstance(corpus, (str, os.PathLike)):
        corpus = list(corpus) if not isinstance(corpus, (list, tuple)) else corpus
        if not (corpus and all(isinstance(c, (str, os.PathLike)) and os.path.isfile(c) for c in corpus)):
            yield from corpus
            return
    for source in resolve(corpus):
        ds = load_documents(source, streaming=True)
        it = iter(ds)
        while True:
            try:
                example = next(it)
            except StopIteration:
                break
            except Exception as e:
                raise explain_read_error(e, source.files(), source.describe()) from e
            yield example["text"]
