"""The ensemble and ``load_predictor``, which serves an ensemble, a classifier or a TF-IDF model alike (the package's
docstring has the directory's layout)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from finetune.saved import CLASSIFIER_FILE, ClassifierDirError, load_classifier
from finetune.scoring.thresholds import THRESHOLDS_FILE, apply_thresholds, load_thresholds, save_thresholds
from finetune.ensemble.tfidf import TFIDF_FILE, TfidfClassifier
from pipeline.job.errors import UserError
from pipeline.job.files import atomic_write_text

ENSEMBLE_FILE = "ensemble.json"
FORMAT = "finetune.ensemble/v1"


class EnsembleError(UserError, ValueError):
    pass


@dataclass
class Ensemble:
    members: list
    member_dirs: list[Path]
    thresholds: np.ndarray | None
    info: dict = field(default_factory=dict)
    directory: Path | None = None
    multilabel: bool = True

    @property
    def label_names(self) -> list[str]:
        return list(self.members[0].label_names)

    def member_probabilities(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> list:
        return [m.predict_proba(texts, batch_size=batch_size, progress=progress) for m in self.members]

    def predict_proba(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        return np.mean(self.member_probabilities(texts, batch_size, progress), axis=0)

    def predict(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        return apply_thresholds(self.predict_proba(texts, batch_size, progress),
                                self.thresholds if self.thresholds is not None else 0.5)


def load_member(directory: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """A finetuned classifier or a TF-IDF model, by what its directory holds."""
    d = Path(directory)
    if (d / TFIDF_FILE).is_file():
        return TfidfClassifier.load(d)
    if (d / ENSEMBLE_FILE).is_file():
        raise EnsembleError(f"{d} is an ensemble; an ensemble's members are classifiers, not ensembles")
    return load_classifier(d, dtype=dtype)


def load_predictor(directory: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """What ``finetune.predict --model`` serves: an ensemble, a classifier or a TF-IDF model."""
    d = Path(directory)
    if not (d / ENSEMBLE_FILE).is_file():
        if not (d / CLASSIFIER_FILE).is_file() and not (d / TFIDF_FILE).is_file() and d.is_dir():
            raise ClassifierDirError(f"{d} is not a classifier directory: no {CLASSIFIER_FILE}, {ENSEMBLE_FILE} "
                                     f"or {TFIDF_FILE} (an interrupted save?)")
        return load_member(d, dtype)
    return load_ensemble(d, dtype)


def load_ensemble(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Ensemble:
    d = Path(directory)
    path = d / ENSEMBLE_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EnsembleError(f"{path}: not valid JSON ({e}); rebuild it with python -m finetune.ensemble") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("members"), list):
        raise EnsembleError(f"{path}: format is not {FORMAT!r}; rebuild it with python -m finetune.ensemble")
    for name, value in (("members", info["members"]), ("label_names", info.get("label_names"))):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (
                name == "members" and not value):
            raise EnsembleError(f"{path}: field {name!r} is not a list of names ({value!r:.80}); rebuild it with "
                                f"python -m finetune.ensemble")
    dirs = [resolve_member(d, m) for m in info["members"]]
    members = [load_member(m, dtype) for m in dirs]
    check_labels(members, dirs, info.get("label_names"))
    thresholds = load_thresholds(d / THRESHOLDS_FILE, info["label_names"]) if info.get("thresholds_file") else None
    return Ensemble(members, dirs, thresholds, info, d)


def resolve_member(directory: Path, member: str) -> Path:
    p = Path(member)
    return p if p.is_absolute() else directory / p


def check_labels(members, dirs, expected: Sequence[str] | None = None) -> list[str]:
    """Every member classifies the same labels in the same order (and multilabel)."""
    names = list(expected) if expected is not None else list(members[0].label_names)
    for m, d in zip(members, dirs):
        if not m.multilabel:
            raise EnsembleError(f"{d}: a single-label classifier; an ensemble averages multilabel classifiers")
        if list(m.label_names) != names:
            raise EnsembleError(f"{d} classifies {list(m.label_names)}, the ensemble {names}; members must share "
                                f"their labels and their order")
    return names


def save_ensemble_dir(directory: str | os.PathLike, member_dirs: Sequence[Path], label_names: Sequence[str],
                      thresholds: np.ndarray | None, **info) -> Path:
    """Write ``thresholds.json`` then ``ensemble.json`` (last, atomically: a reader never sees new members with
    old thresholds). Members inside the directory are named relative to it, so it can be moved whole."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / ENSEMBLE_FILE).unlink(missing_ok=True)
    root = d.resolve()
    names = []
    for m in member_dirs:
        m = Path(m).resolve()
        names.append(str(m.relative_to(root)) if m.is_relative_to(root) else str(m))
    if thresholds is not None:
        save_thresholds(d / THRESHOLDS_FILE, thresholds, label_names, tuned_on="holdout of the members' training file")
    doc = {"format": FORMAT, "members": names, "label_names": list(label_names),
           "thresholds_file": THRESHOLDS_FILE if thresholds is not None else None, **info}
    atomic_write_text(d / ENSEMBLE_FILE, json.dumps(doc, indent=2) + "\n")
    return d
