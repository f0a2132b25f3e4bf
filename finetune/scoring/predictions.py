"""Prediction files in the official SemEval-2018 E-c format, the one the official scorer reads.

``ID<TAB>Tweet<TAB>anger<TAB>...<TAB>trust`` then one line per tweet with 0/1 in each label column,
UTF-8, LF line ends. The official scorer (``utils.evaluate_multilabel``) splits every line on tabs and
needs exactly 13 fields, aligns rows by ID and requires as many lines as the gold file; so the IDs are
written as given, and a tab or line break inside a tweet is written as a space (the Tweet column is not
scored; the real tweets hold none). Files with another label set (e.g. the 8 Plutchik emotions) are
written the same way, with those columns; the official scorer only reads the 11-label layout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from finetune._io import atomic_write_text
from finetune.data import EC_ID_COLUMN, EC_TEXT_COLUMN, SEMEVAL_EC_LABELS, LabeledTexts, load_semeval_ec

_LINE_BREAKING = re.compile(r"[\t\r\n\v\f\x1c-\x1e\x85\u2028\u2029]")  # what would split a field or a line


def write_predictions(path: str | os.PathLike, ids: Sequence[str], texts: Sequence[str], predictions: np.ndarray,
                      label_names: Sequence[str] = SEMEVAL_EC_LABELS) -> Path:
    """Write 0/1 predictions [n, k] in E-c format (atomically). ``label_names`` are the header's label
    columns, in the order of the prediction columns."""
    pred = np.asarray(predictions)
    n, k = len(ids), len(label_names)
    if len(texts) != n or pred.shape != (n, k):
        raise ValueError(f"{n} ids, {len(texts)} texts and predictions {list(pred.shape)} for {k} labels disagree")
    if not np.isin(pred, (0, 1)).all():
        raise ValueError("predictions must be 0/1 (apply the thresholds first)")
    if len(set(ids)) != n:
        raise ValueError("prediction IDs must be unique (the scorer aligns rows by ID)")
    for tid in ids:
        if not str(tid).strip() or _LINE_BREAKING.search(str(tid)):
            raise ValueError(f"ID {tid!r} is empty or holds a tab or line break")
    header = "\t".join([EC_ID_COLUMN, EC_TEXT_COLUMN, *label_names])
    rows = [header]
    for tid, text, row in zip(ids, texts, pred.astype(np.int8)):
        rows.append("\t".join([str(tid), _LINE_BREAKING.sub(" ", text), *("1" if v else "0" for v in row)]))
    return atomic_write_text(path, "\n".join(rows) + "\n")


def write_labeled_predictions(path: str | os.PathLike, data: LabeledTexts, predictions: np.ndarray) -> Path:
    """``write_predictions`` with the IDs, texts and label names of the file the predictions are for."""
    return write_predictions(path, data.ids, data.texts, predictions, data.label_names)


def read_predictions(path: str | os.PathLike, label_names: Sequence[str] | None = None) -> LabeledTexts:
    """Read an E-c format file (predictions or gold); ``label_names`` None = the header's label columns.
    Same checks as ``finetune.data.load_semeval_ec``."""
    return load_semeval_ec(path, labels=label_names)
