"""Labelled text data for classification: SemEval-2018 E-c, SST-2, and any CSV/TSV/JSON(L) file.

Everything ends up as a ``LabeledTexts``: texts, ids, a label matrix ``np.int8 [n, k]`` (multi-hot for
multilabel tasks, one-hot for single-label ones), the label names and the source path. ``to_hf()`` gives
the same rows as a ``datasets.Dataset``.

Bad input is refused, never repaired: a missing column, a label other than 0/1, an empty text or a
duplicated ID raises ``DataFormatError`` naming the file, the 1-based line (the header is line 1; JSON
arrays, which have no meaningful lines, give the 1-based record) and the column.

Normalisation (``finetune.normalize``) is not applied here: the loader returns the text as written.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from pipeline.job.errors import UserError

SEMEVAL_EC_LABELS: tuple[str, ...] = ("anger", "anticipation", "disgust", "fear", "joy", "love", "optimism",
                                      "pessimism", "sadness", "surprise", "trust")
# Plutchik's eight basic emotions, the label set of the paper's other tweet datasets.
PLUTCHIK_LABELS: tuple[str, ...] = ("anger", "anticipation", "disgust", "fear", "joy", "sadness", "surprise", "trust")
SST2_LABELS: tuple[str, ...] = ("negative", "positive")

EC_ID_COLUMN, EC_TEXT_COLUMN = "ID", "Tweet"
EC_UNLABELED = "NONE"  # the official test file before gold release carries NONE in every label cell

MULTILABEL, SINGLE_LABEL = "multilabel", "single_label"


class DataFormatError(UserError, ValueError):
    """A data file that cannot be used as given; the message names the file, line (or record) and column."""

    def __init__(self, path: str | os.PathLike, problem: str, *, line: int | None = None,
                 record: int | None = None, column: str | None = None):
        self.path, self.line, self.record, self.column, self.problem = str(path), line, record, column, problem
        where = [str(path)]
        if line is not None:
            where.append(f"line {line}")
        elif record is not None:
            where.append(f"record {record}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {problem}")


@dataclass(frozen=True, eq=False, repr=False)
class LabeledTexts:
    """Rows of a labelled text file. ``labels`` is None for an unlabelled file (texts to predict)."""

    texts: list[str]
    ids: list[str]
    labels: np.ndarray | None  # int8 [n, k]: multi-hot (multilabel) or one-hot (single_label)
    label_names: tuple[str, ...]
    source: str = ""
    task: str = MULTILABEL
    text_column: str = field(default="text", compare=False)

    def __post_init__(self):
        n = len(self.texts)
        if len(self.ids) != n:
            raise ValueError(f"{len(self.ids)} ids for {n} texts")
        if self.task not in (MULTILABEL, SINGLE_LABEL):
            raise ValueError(f"task must be {MULTILABEL!r} or {SINGLE_LABEL!r}, got {self.task!r}")
        if self.labels is not None:
            if self.labels.dtype != np.int8 or self.labels.shape != (n, len(self.label_names)):
                raise ValueError(f"labels must be int8 [{n}, {len(self.label_names)}], "
                                 f"got {self.labels.dtype} {list(self.labels.shape)}")
            if self.task == SINGLE_LABEL and n and not (self.labels.sum(axis=1) == 1).all():
                raise ValueError("single-label rows must be one-hot")

    def __len__(self) -> int:
        return len(self.texts)

    def __repr__(self) -> str:
        labels = "unlabelled" if self.labels is None else f"{self.task} over {list(self.label_names)}"
        return f"LabeledTexts({len(self)} texts, {labels}, source={self.source!r})"

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def label_counts(self) -> np.ndarray:
        """Positives per label, int64 [k]."""
        self._require_labels()
        return self.labels.sum(axis=0, dtype=np.int64)

    def class_indices(self) -> np.ndarray:
        """Single-label targets as class indices, int64 [n] (what softmax cross-entropy takes)."""
        self._require_labels()
        if self.task != SINGLE_LABEL:
            raise ValueError("class_indices() is for single-label data; multilabel data uses the label matrix")
        return self.labels.argmax(axis=1).astype(np.int64)

    def select_labels(self, names: Sequence[str]) -> "LabeledTexts":
        """Keep the named label columns, in the order given (e.g. ``PLUTCHIK_LABELS`` out of E-c's 11)."""
        if self.task != SINGLE_LABEL and list(names) == list(self.label_names):
            return self
        if self.task == SINGLE_LABEL:
            raise ValueError("a label subset of single-label data would leave rows without a class")
        missing = [name for name in names if name not in self.label_names]
        if missing:
            raise ValueError(f"labels {missing} are not in {self.source or 'the data'} (has {list(self.label_names)})")
        if len(set(names)) != len(names):
            raise ValueError(f"repeated label in {list(names)}")
        cols = [self.label_names.index(name) for name in names]
        labels = None if self.labels is None else np.ascontiguousarray(self.labels[:, cols])
        return replace(self, labels=labels, label_names=tuple(names))

    def map_texts(self, fn: Callable[[str], str]) -> "LabeledTexts":
        """The same rows with ``fn`` applied to every text (e.g. a ``TweetNormalizer``)."""
        return replace(self, texts=[fn(t) for t in self.texts])

    def subset(self, indices: Sequence[int] | np.ndarray) -> "LabeledTexts":
        idx = np.asarray(indices, dtype=np.int64)
        labels = None if self.labels is None else self.labels[idx]
        return replace(self, texts=[self.texts[i] for i in idx], ids=[self.ids[i] for i in idx], labels=labels)

    def to_hf(self):
        """A ``datasets.Dataset`` with columns id, text and labels (int8 list; multilabel) or label (ClassLabel)."""
        # datasets is heavy; only reading a file through it needs it
        import datasets  # noqa: PLC0415

        columns: dict[str, Any] = {"id": self.ids, "text": self.texts}
        features = {"id": datasets.Value("string"), "text": datasets.Value("string")}
        if self.labels is not None:
            if self.task == SINGLE_LABEL:
                columns["label"] = self.class_indices().tolist()
                features["label"] = datasets.ClassLabel(names=list(self.label_names))
            else:
                columns["labels"] = self.labels.tolist()
                features["labels"] = datasets.List(datasets.Value("int8"), length=self.num_labels)
        return datasets.Dataset.from_dict(columns, features=datasets.Features(features))

    def _require_labels(self):
        if self.labels is None:
            raise ValueError(f"{self.source or 'this data'} has no labels")


# --------------------------------------------------------------------------------------------------
# SemEval-2018 Task 1 E-c: "ID<TAB>Tweet<TAB>anger<TAB>...<TAB>trust", one tweet per line, no quoting.
# Parsed exactly as the official scorer splits it (on tabs), so a file this accepts, the scorer accepts.

def load_semeval_ec(path: str | os.PathLike, labels: Sequence[str] | None = SEMEVAL_EC_LABELS, *,
                    require_labels: bool = True) -> LabeledTexts:
    """Read an E-c file. ``labels``: the label columns to keep, in that order (they must all be in the
    header; default the official 11; ``None`` = every column after ID and Tweet). ``require_labels=False``
    also accepts an unlabelled file whose label cells are all ``NONE`` (labels=None in the result)."""
    path = Path(path)
    lines = _read_lines(path)
    if not lines:
        raise DataFormatError(path, "empty file (expected a header 'ID<TAB>Tweet<TAB><labels>')", line=1)
    header = lines[0].split("\t")
    _check_ec_layout(path, header)
    _check_header_names(path, header)
    for required in (EC_ID_COLUMN, EC_TEXT_COLUMN):
        if required not in header:
            raise DataFormatError(path, f"missing column {required!r}; the header has {header}", line=1)
    label_names = tuple(labels) if labels is not None else tuple(
        c for c in header if c not in (EC_ID_COLUMN, EC_TEXT_COLUMN))
    if not label_names:
        raise DataFormatError(path, "no label columns in the header", line=1)
    for name in label_names:
        if name not in header:
            raise DataFormatError(path, f"missing label column {name!r}; the header has {header}", line=1)
    id_col, text_col = header.index(EC_ID_COLUMN), header.index(EC_TEXT_COLUMN)
    label_cols = [header.index(name) for name in label_names]

    n = len(lines) - 1
    ids, texts = [], []
    matrix = np.zeros((n, len(label_names)), dtype=np.int8)
    first_unlabeled = first_labeled = None  # line numbers, to name the culprit of a mixed file
    first_seen: dict[str, int] = {}
    for row, line in enumerate(lines[1:]):
        lineno = row + 2
        fields = line.split("\t")
        if len(fields) != len(header):
            problem = "blank line" if not line.strip() else (
                f"expected {len(header)} tab-separated fields (as in the header), found {len(fields)}")
            raise DataFormatError(path, problem, line=lineno)
        tweet_id = fields[id_col].strip()
        if not tweet_id:
            raise DataFormatError(path, "empty ID", line=lineno, column=EC_ID_COLUMN)
        if tweet_id in first_seen:
            raise DataFormatError(path, f"duplicated ID {tweet_id!r} (first on line {first_seen[tweet_id]})",
                                  line=lineno, column=EC_ID_COLUMN)
        first_seen[tweet_id] = lineno
        text = fields[text_col]
        if not text.strip():
            raise DataFormatError(path, "empty text", line=lineno, column=EC_TEXT_COLUMN)
        if "\x00" in text:
            raise DataFormatError(path, f"a NUL byte in the text (at character {text.index(chr(0)) + 1}): the line "
                                        f"is damaged or binary; remove the NUL byte or the line", line=lineno,
                                  column=EC_TEXT_COLUMN)
        cells = [fields[c].strip() for c in label_cols]
        if all(cell == EC_UNLABELED for cell in cells):
            if require_labels:
                raise DataFormatError(path, f"label cells are {EC_UNLABELED!r} (this file must be labelled)",
                                      line=lineno, column=label_names[0])
            first_unlabeled = first_unlabeled or lineno
        else:
            for j, cell in enumerate(cells):
                if cell == "1":
                    matrix[row, j] = 1
                elif cell != "0":
                    raise DataFormatError(path, f"label must be 0 or 1, found {cell!r}", line=lineno,
                                          column=label_names[j])
            first_labeled = first_labeled or lineno
        if first_unlabeled and first_labeled:
            raise DataFormatError(path, f"rows labelled 0/1 and rows labelled {EC_UNLABELED!r} are mixed (first "
                                        f"of each: lines {first_labeled} and {first_unlabeled})",
                                  line=max(first_labeled, first_unlabeled), column=label_names[0])
        ids.append(tweet_id)
        texts.append(text)
    return LabeledTexts(texts=texts, ids=ids, labels=None if first_unlabeled else matrix, label_names=label_names,
                        source=str(path), task=MULTILABEL, text_column=EC_TEXT_COLUMN)


def _read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 file without their terminators (LF or CRLF); a BOM on line 1 is dropped."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataFormatError(path, "no such file") from None
    parts = raw.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()  # the final newline ends the last line; it does not start a new one
    lines = []
    for i, part in enumerate(parts):
        try:
            text = part.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataFormatError(path, f"not UTF-8 ({e.reason} at byte {e.start} of the line)", line=i + 1) from None
        lines.append(text[:-1] if text.endswith("\r") else text)
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return lines


def _check_ec_layout(path: Path, header: Sequence[str]) -> None:
    """The two mistakes that otherwise read as a strange header: another separator, and no header at all."""
    if len(header) == 1 and (EC_ID_COLUMN in header[0] or EC_TEXT_COLUMN in header[0]):
        sep = next((s for s in (",", ";", "|", " ") if s in header[0]), None)
        raise DataFormatError(path, f"the header has no tab{f' (it is separated by {sep!r})' if sep else ''}: E-c "
                                    f"files are tab-separated ('ID<TAB>Tweet<TAB><labels>'); save it with tabs",
                              line=1)
    if EC_ID_COLUMN not in header and EC_TEXT_COLUMN not in header and len(header) >= 3 and \
            all(c.strip() in ("0", "1", "NONE") for c in header[2:]):
        raise DataFormatError(path, "the first line is a data row, not a header: E-c files start with the header "
                                    "'ID<TAB>Tweet<TAB><labels>'; add it", line=1)


def _check_header_names(path: Path, header: Sequence[str]):
    seen = set()
    for name in header:
        if not name.strip():
            raise DataFormatError(path, f"empty column name in the header {list(header)}", line=1)
        if name in seen:
            raise DataFormatError(path, "column named twice in the header", line=1, column=name)
        seen.add(name)


# --------------------------------------------------------------------------------------------------
# Any other labelled file, read with Hugging Face `datasets`.

_DELIMITED = {".csv": ",", ".tsv": "\t", ".tab": "\t", ".txt": "\t"}
_JSON = {".json", ".jsonl", ".ndjson"}


def load_sst2(path: str | os.PathLike) -> LabeledTexts:
    """Binary sentiment, SST-2 as ``sentence<TAB>label`` with label 0 = negative, 1 = positive."""
    return load_labeled_file(path, text_column="sentence", label_column="label", label_names=SST2_LABELS)


def load_labeled_file(path: str | os.PathLike, *, text_column: str = "text", id_column: str | None = None,
                      label_columns: Sequence[str] | None = None, label_list_column: str | None = None,
                      label_column: str | None = None, label_names: Sequence[str] | None = None,
                      label_separator: str = ",", labels: Sequence[str] | None = None,
                      delimiter: str | None = None, quoting: int | None = None,
                      json_field: str | None = None) -> LabeledTexts:
    """A CSV / TSV / JSON / JSON Lines file, through ``datasets``. Name the labels in one of three ways:

    * ``label_columns``: one 0/1 column per label (multilabel; the column names are the label names);
    * ``label_list_column``: one column holding each row's labels (multilabel): a list of label names or
      indices in JSON, a ``label_separator``-separated string in CSV/TSV; an empty list is a row with none;
    * ``label_column``: one class per row (single-label), a label name or an index into ``label_names``.

    ``label_names`` fixes the label set and its order (otherwise the sorted values found); ``labels``
    then keeps a subset (multilabel only). With none of the three, the file is unlabelled (texts to
    predict). ``delimiter`` and ``quoting`` (a ``csv.QUOTE_*``) default by extension: ``.csv`` is
    comma-separated with quotes, ``.tsv`` / ``.tab`` / ``.txt`` tab-separated without quoting.
    ``json_field``: the key under which a JSON file keeps its list of records.
    """
    # datasets is heavy; only reading a file through it needs it
    import datasets  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise DataFormatError(path, "no such file")
    suffix = path.suffix.lower()
    locate: Callable[[int], dict]
    wanted = [c for c in (text_column, id_column, label_list_column, label_column) if c] + list(label_columns or ())
    try:
        if suffix in _JSON:
            dataset = datasets.load_dataset("json", data_files=str(path), field=json_field, split="train")
            locate = _json_locator(path, len(dataset), json_field)
        elif suffix in _DELIMITED or delimiter is not None:
            sep = delimiter if delimiter is not None else _DELIMITED[suffix]
            if quoting is None:
                quoting = csv.QUOTE_MINIMAL if sep == "," else csv.QUOTE_NONE
            header, record_lines = _scan_delimited(path, sep, quoting)
            _require_columns(path, header, wanted)
            # Every column as a string: no "NA"/"null" texts turned into missing values, no 0/1 turned into floats.
            features = datasets.Features({name: datasets.Value("string") for name in header})
            dataset = datasets.load_dataset("csv", data_files=str(path), split="train", sep=sep, quoting=quoting,
                                            keep_default_na=False, na_filter=False, features=features)
            if len(dataset) != len(record_lines):
                raise DataFormatError(path, f"read {len(dataset)} records with pandas but {len(record_lines)} with "
                                            "the csv module; check the quoting (pass quoting=csv.QUOTE_*)")
            locate = lambda i: {"line": record_lines[i]}  # noqa: E731
        else:
            raise DataFormatError(path, f"unknown file type {suffix!r}: use .csv, .tsv, .json or .jsonl "
                                        "(or pass delimiter= for another delimited text file)")
    except DataFormatError:
        raise
    except Exception as e:  # datasets / pandas / pyarrow parse errors: keep their detail, name the file
        raise DataFormatError(path, f"cannot be read as {suffix or 'data'}: {type(e).__name__}: {e}") from e
    if suffix in _JSON:
        _require_columns(path, dataset.column_names, wanted, where={"record": 1})
    return from_hf_dataset(dataset, text_column=text_column, id_column=id_column, label_columns=label_columns,
                           label_list_column=label_list_column, label_column=label_column, label_names=label_names,
                           label_separator=label_separator, labels=labels, source=str(path), locate=locate)


def load_data(path: str | os.PathLike, **kwargs) -> LabeledTexts:
    """Load by looking at the file: an E-c header (``ID<TAB>Tweet<TAB>...``) -> ``load_semeval_ec`` (keyword
    ``labels``, ``require_labels``); SST-2's ``sentence<TAB>label`` -> ``load_sst2``; anything else ->
    ``load_labeled_file(path, **kwargs)``."""
    path = Path(path)
    header = _header_line(path).split("\t") if path.suffix.lower() in (".tsv", ".txt", ".tab", "") else []
    if header[:2] == [EC_ID_COLUMN, EC_TEXT_COLUMN] and set(kwargs) <= {"labels", "require_labels"}:
        return load_semeval_ec(path, **kwargs)
    if header == ["sentence", "label"] and not kwargs:
        return load_sst2(path)
    if header and not kwargs and "text" not in header:
        _check_ec_layout(path, header)  # a comma-separated E-c file, or one without its header
    return load_labeled_file(path, **kwargs)


def _header_line(path: Path) -> str:
    """The first line, decoded alone (a bad byte further on is reported at its own line, by the reader)."""
    if path.is_dir():
        raise DataFormatError(path, "is a directory; give a data file")
    try:
        with open(path, "rb") as f:
            raw = f.readline()
    except FileNotFoundError:
        raise DataFormatError(path, "no such file") from None
    try:
        return raw.decode("utf-8-sig").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise DataFormatError(path, f"not UTF-8 ({e.reason} at byte {e.start} of the line); save it as UTF-8",
                              line=1) from None


def require_rows(data: "LabeledTexts", path, what: str = "texts") -> "LabeledTexts":
    """Refuse a file that holds a header and nothing else."""
    if len(data) == 0:
        raise DataFormatError(path, f"holds no {what} (a header and no rows); give a file with at least one row")
    return data


def from_hf_dataset(dataset, *, text_column: str = "text", id_column: str | None = None,
                    label_columns: Sequence[str] | None = None, label_list_column: str | None = None,
                    label_column: str | None = None, label_names: Sequence[str] | None = None,
                    label_separator: str = ",", labels: Sequence[str] | None = None, source: str = "<dataset>",
                    locate: Callable[[int], dict] | None = None) -> LabeledTexts:
    """Validate and convert a ``datasets.Dataset`` (loaded from a file or the Hub) into ``LabeledTexts``.
    Arguments as ``load_labeled_file``; ``locate(i)`` maps record i to ``{"line": n}`` or ``{"record": n}``
    for error messages (default: the 1-based record)."""
    locate = locate or (lambda i: {"record": i + 1})
    modes = [m for m in (label_columns, label_list_column, label_column) if m]
    if len(modes) > 1:
        raise ValueError("give one of label_columns, label_list_column, label_column")
    wanted = [c for c in (text_column, id_column, label_list_column, label_column) if c] + list(label_columns or ())
    _require_columns(source, dataset.column_names, wanted, where={"record": 1} if len(dataset) else {})

    n = len(dataset)
    texts = dataset[text_column]
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            problem = "empty text" if isinstance(text, str) or text is None else f"text is not a string: {text!r}"
            raise DataFormatError(source, problem, column=text_column, **locate(i))
    if id_column:
        ids = []
        first_seen: dict[str, int] = {}
        for i, value in enumerate(dataset[id_column]):
            tid = "" if value is None else str(value).strip()
            if not tid:
                raise DataFormatError(source, "empty ID", column=id_column, **locate(i))
            if tid in first_seen:
                prev = locate(first_seen[tid])
                prev_where = f"line {prev['line']}" if "line" in prev else f"record {prev['record']}"
                raise DataFormatError(source, f"duplicated ID {tid!r} (first on {prev_where})", column=id_column,
                                      **locate(i))
            first_seen[tid] = i
            ids.append(tid)
    else:
        ids = [str(i) for i in range(n)]

    task = SINGLE_LABEL if label_column else MULTILABEL
    if label_columns:
        names = tuple(label_columns)
        matrix = np.zeros((n, len(names)), dtype=np.int8)
        for j, column in enumerate(names):
            for i, value in enumerate(dataset[column]):
                bit = _binary(value)
                if bit is None:
                    raise DataFormatError(source, f"label must be 0 or 1, found {value!r}", column=column, **locate(i))
                matrix[i, j] = bit
    elif label_list_column:
        names, matrix = _from_label_lists(dataset[label_list_column], label_names, label_separator, source,
                                          label_list_column, locate)
    elif label_column:
        names, matrix = _from_classes(dataset[label_column], label_names, source, label_column, locate)
    else:
        names, matrix = tuple(label_names or ()), None
    if label_columns and label_names is not None and tuple(label_names) != names:
        raise ValueError(f"label_names {list(label_names)} differ from label_columns {list(names)}")
    result = LabeledTexts(texts=list(texts), ids=ids, labels=matrix, label_names=names, source=source, task=task,
                          text_column=text_column)
    return result.select_labels(labels) if labels is not None else result


def _binary(value) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return int(value)
    if isinstance(value, (float, np.floating)) and value in (0.0, 1.0):
        return int(value)
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    return None


def _as_index(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _from_label_lists(values, label_names, separator, source, column, locate):
    rows: list[list] = []
    for i, value in enumerate(values):
        if isinstance(value, str):
            items = [s.strip() for s in value.split(separator)] if separator else [value.strip()]
            items = [s for s in items if s]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise DataFormatError(source, f"expected a list of labels, found {value!r}", column=column, **locate(i))
        rows.append(items)
    if label_names is None:
        found = {item for items in rows for item in items}
        if any(not isinstance(item, str) for item in found):
            raise ValueError(f"{source}: column {column!r} holds label indices; pass label_names to name them")
        label_names = sorted(found)
    return _one_hot(rows, label_names, lambda i, item: f"unknown label {item!r}", "labels", source, column, locate)


def _one_hot(rows, label_names, unknown, kind, source, column, locate):
    """(names, int8 [n, k]) with a 1 for each item of each row: an item is a name or an index into the names."""
    names = tuple(label_names)
    index = {name: j for j, name in enumerate(names)}
    matrix = np.zeros((len(rows), len(names)), dtype=np.int8)
    for i, items in enumerate(rows):
        for item in items:
            j = index.get(item) if isinstance(item, str) else None
            if j is None:
                k = _as_index(item)
                j = k if k is not None and 0 <= k < len(names) else None
            if j is None:
                raise DataFormatError(source, f"{unknown(i, item)} ({kind}: {list(names)})", column=column,
                                      **locate(i))
            matrix[i, j] = 1
    return names, matrix


def _from_classes(values, label_names, source, column, locate):
    values = list(values)
    for i, value in enumerate(values):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise DataFormatError(source, "missing label", column=column, **locate(i))
        if not isinstance(value, (str, int, np.integer)) or isinstance(value, bool):
            raise DataFormatError(source, f"expected a class name or index, found {value!r}", column=column,
                                  **locate(i))
    keys = [v.strip() if isinstance(v, str) else v for v in values]
    if label_names is None:
        found = set(keys)
        if all(_as_index(k) is not None for k in found):
            label_names = [str(k) for k in sorted(found, key=_as_index)]
        else:
            label_names = sorted(str(k) for k in found)
        keys = [str(k) for k in keys]
    return _one_hot([[k] for k in keys], label_names, lambda i, _: f"unknown class {values[i]!r}", "classes",
                    source, column, locate)


def _require_columns(source, header: Sequence[str], wanted: Iterable[str], where: dict | None = None):
    where = {"line": 1} if where is None else where
    for name in wanted:
        if name not in header:
            raise DataFormatError(source, f"missing column {name!r}; the file has columns {list(header)}", **where)


def _scan_delimited(path: Path, sep: str, quoting: int) -> tuple[list[str], list[int]]:
    """Header and the first physical line of each record (quoted fields may span lines), checking that
    every record has as many fields as the header. Blank lines are skipped, as pandas skips them."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=sep, quoting=quoting, strict=True)
        header: list[str] | None = None
        record_lines: list[int] = []
        start = 1
        try:
            for fields in reader:
                if fields:
                    if header is None:
                        header = fields
                        _check_header_names(path, header)
                    elif len(fields) != len(header):
                        raise DataFormatError(path, f"expected {len(header)} fields (as in the header), found "
                                                    f"{len(fields)}", line=start)
                    else:
                        record_lines.append(start)
                start = reader.line_num + 1
        except csv.Error as e:
            raise DataFormatError(path, f"malformed {'CSV' if sep == ',' else 'delimited'} record: {e}",
                                  line=start) from None
        except UnicodeDecodeError as e:
            raise DataFormatError(path, f"not UTF-8 ({e.reason})", line=start) from None
    if header is None:
        raise DataFormatError(path, "empty file (expected a header line)", line=1)
    return header, record_lines


def _json_locator(path: Path, n: int, json_field: str | None) -> Callable[[int], dict]:
    """JSON Lines: record i is the i-th non-blank line. A JSON document (array or object) has no useful
    line numbers, so its records are named by their 1-based position."""
    if json_field is None:
        line_numbers = []
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    line_numbers.append(lineno)
        if len(line_numbers) == n and n > 0:
            try:
                json.loads(_first_nonblank(path))
                is_lines = True
            except ValueError:
                is_lines = False
            if is_lines:
                return lambda i: {"line": line_numbers[i]}
    return lambda i: {"record": i + 1}


def _first_nonblank(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if raw.strip():
                return raw
    return ""


# -- texts to classify (finetune.predict) ---------------------------------------------------------------------------

def read_texts(path: str, label_names, text_column: str | None, id_column: str | None):
    """The file's texts, with the model's label columns when it has them all (else unlabelled)."""
    p = Path(path)
    if not p.is_file() and not p.is_dir():
        raise DataFormatError(p, "no such file")
    header = _header_line(p).split("\t")
    if text_column is None and header[:2] != ["ID", "Tweet"] and "text" not in header \
            and p.suffix.lower() not in _JSON:
        _check_ec_layout(p, header)
    return require_rows(_read_texts(p, header, label_names, text_column, id_column), p)


def _read_texts(p: Path, header: list[str], label_names, text_column: str | None, id_column: str | None):
    if text_column is None and header[:2] == ["ID", "Tweet"]:
        data = load_semeval_ec(p, labels=None, require_labels=False)
        if data.labels is not None and all(name in data.label_names for name in label_names):
            return data.select_labels(label_names)
        _note_partial_labels(p, data.label_names if data.labels is not None else [], label_names)
        return _unlabelled(data)  # labelled with other columns than the model's: predictions only
    columns = _columns(p)
    kwargs = {"text_column": text_column or "text", "id_column": id_column}
    if all(name in columns for name in label_names):
        kwargs["label_columns"] = list(label_names)
    else:
        _note_partial_labels(p, columns, label_names)
    return load_labeled_file(p, **kwargs)


def _note_partial_labels(path: Path, columns, label_names) -> None:
    """A file with some but not all of the model's label columns is read as unlabelled: say so."""
    present = [n for n in label_names if n in columns]
    if present:
        missing = [n for n in label_names if n not in columns]
        print(f"note: {path}: has the label column(s) {', '.join(present)} but not {', '.join(missing)} of the "
              f"model's labels; it is read as unlabelled (predictions only, no scores); add the missing columns "
              f"to have it scored", file=sys.stderr)


def _unlabelled(data):
    return replace(data, labels=None)


def _columns(path: Path) -> list[str]:
    try:
        return _first_columns(path)
    except UnicodeDecodeError as e:
        raise DataFormatError(path, f"not UTF-8 ({e.reason}); save it as UTF-8") from None


def _first_columns(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "{}")
        try:
            record = json.loads(first)
            return list(record) if isinstance(record, dict) else []
        except ValueError:
            return []
    sep = "," if suffix == ".csv" else "\t"
    with open(path, encoding="utf-8-sig", newline="") as f:
        return next(csv.reader(f, delimiter=sep), [])
