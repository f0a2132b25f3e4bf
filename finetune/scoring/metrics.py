"""Classification metrics (scikit-learn), ``eval.json`` and the per-class F1 chart.

Multilabel scores follow the official SemEval-2018 Task 1 E-c scorer (felipebravom/SemEval_2018_Task_1_Eval,
``utils.evaluate_multilabel``), which calls scikit-learn of its day:
  * micro-F1 and macro-F1: ``f1_score(average="micro" | "macro")``; macro-F1 is the mean of per-class F1
    (not the F1 of mean precision and recall), and a class with no true and no predicted positives
    scores F1 = 0 in it (scikit-learn's ill-defined-F rule, ``zero_division=0`` here);
  * Jaccard accuracy: ``jaccard_similarity_score`` (since removed from scikit-learn): the mean over
    tweets of |pred ∩ gold| / |pred ∪ gold|, where a tweet with an empty gold set and an empty
    predicted set scores 1 (that function set such rows to 1.0: "lim x/x = 1"). Today's equivalent is
    ``jaccard_score(average="samples", zero_division=1.0)``, used below.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from sklearn.metrics import accuracy_score, f1_score, jaccard_score, precision_recall_fscore_support

from finetune._io import atomic_write_figure, atomic_write_text
from finetune.data import SEMEVAL_EC_LABELS
from finetune.scoring.thresholds import apply_thresholds

AT_HALF, TUNED = "at_0.5", "tuned"


def jaccard_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """The official E-c "accuracy": mean per-tweet Jaccard index, an empty-vs-empty tweet scoring 1."""
    y, p = _check_binary(y_true, y_pred)
    return float(jaccard_score(y, p, average="samples", zero_division=1.0))


def multilabel_scores(y_true: np.ndarray, y_pred: np.ndarray, label_names: Sequence[str] | None = None) -> dict:
    """Scores of 0/1 predictions [n, k]: micro/macro F1, precision, recall, Jaccard accuracy, exact match,
    and per class precision / recall / F1 / support (true positives in y_true) / predicted (count)."""
    y, p = _check_binary(y_true, y_pred)
    names = _names(label_names, y.shape[1])
    precision, recall, f1, support = precision_recall_fscore_support(y, p, average=None, zero_division=0)
    micro_p, micro_r, micro_f1, _ = precision_recall_fscore_support(y, p, average="micro", zero_division=0)
    return {
        "micro_f1": float(micro_f1),
        "macro_f1": float(f1_score(y, p, average="macro", zero_division=0)),
        "jaccard": jaccard_accuracy(y, p),
        "micro_precision": float(micro_p),
        "micro_recall": float(micro_r),
        "macro_precision": float(np.mean(precision)),
        "macro_recall": float(np.mean(recall)),
        "exact_match": float(np.mean(np.all(y == p, axis=1))) if len(y) else 0.0,
        "n": int(y.shape[0]),
        "per_class": {name: {"precision": float(precision[j]), "recall": float(recall[j]), "f1": float(f1[j]),
                             "support": int(support[j]), "predicted": int(p[:, j].sum())}
                      for j, name in enumerate(names)},
    }


def single_label_scores(y_true: Sequence[int] | np.ndarray, y_pred: Sequence[int] | np.ndarray,
                        label_names: Sequence[str]) -> dict:
    """Scores of class-index predictions [n] (e.g. SST-2): accuracy, macro-F1, per-class P/R/F1/support."""
    y, p = np.asarray(y_true), np.asarray(y_pred)
    if y.ndim != 1 or y.shape != p.shape:
        raise ValueError(f"class indices must both be [n], got {list(y.shape)} and {list(p.shape)}")
    k = len(label_names)
    labels = list(range(k))
    precision, recall, f1, support = precision_recall_fscore_support(y, p, labels=labels, average=None,
                                                                     zero_division=0)
    return {
        "accuracy": float(accuracy_score(y, p)) if len(y) else 0.0,
        "macro_f1": float(f1_score(y, p, labels=labels, average="macro", zero_division=0)),
        "n": int(y.size),
        "per_class": {name: {"precision": float(precision[j]), "recall": float(recall[j]), "f1": float(f1[j]),
                             "support": int(support[j]), "predicted": int(np.sum(p == j))}
                      for j, name in enumerate(label_names)},
    }


def evaluate_probabilities(y_true: np.ndarray, probs: np.ndarray, label_names: Sequence[str] | None = None,
                           thresholds: Sequence[float] | np.ndarray | None = None) -> dict:
    """Multilabel scores of probabilities [n, k] at 0.5 and, when given, at the tuned per-class thresholds:
    ``{"labels": [...], "at_0.5": scores, "tuned": {**scores, "thresholds": {label: t}}}``."""
    probs = np.asarray(probs, dtype=np.float64)
    names = _names(label_names, probs.shape[1] if probs.ndim == 2 else 0)
    result = {"labels": list(names), AT_HALF: multilabel_scores(y_true, apply_thresholds(probs, 0.5), names)}
    if thresholds is not None:
        t = np.asarray(thresholds, dtype=np.float64)
        tuned = multilabel_scores(y_true, apply_thresholds(probs, t), names)
        tuned["thresholds"] = {name: float(x) for name, x in zip(names, t)}
        result[TUNED] = tuned
    return result


def write_eval_json(path: str | os.PathLike, results: Mapping, **metadata) -> Path:
    """Write ``{**metadata, **results}`` as JSON, atomically. NumPy scalars/arrays become plain JSON; NaN and
    infinities are refused (they are not JSON)."""
    doc = _plain({**metadata, **results})
    return atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False, ensure_ascii=False) + "\n")


# Per-class F1 on the E-c test set published by Kant et al. 2018 ("Practical Text Classification With Large
# Pre-Trained Language Models", arXiv:1812.01207, abstract): the classes the paper names with a value.
PUBLISHED_EC_TEST_F1 = {"anger": 0.78, "anticipation": 0.42, "disgust": 0.77, "fear": 0.73, "surprise": 0.37}


def per_class_f1_figure(results: Mapping, title: str | None = None, reference: Mapping[str, float] | None = None,
                        reference_label: str = "published"):
    """A matplotlib ``Figure`` (no pyplot, no global backend change) of per-class F1 as grouped bars, one
    group per class, one bar per setting in ``results`` (``evaluate_probabilities`` output) or per system when
    ``results`` maps system names to score dicts. Class support is shown under each class name.
    ``reference`` (class -> F1, e.g. ``PUBLISHED_EC_TEST_F1``) is drawn as a marker over the classes it has."""
    # matplotlib only when a chart is drawn
    from matplotlib.figure import Figure  # noqa: PLC0415

    series = _series(results)
    first = next(iter(series.values()))
    names = list(first["per_class"])
    width = 0.8 / len(series)
    x = np.arange(len(names))
    fig = Figure(figsize=(max(7.0, len(names) * (0.3 * len(series) + 0.4) + 1.5), 4.5 + 0.22 * len(series)),
                 layout="constrained")
    ax = fig.add_subplot()
    for i, (label, scores) in enumerate(series.items()):
        values = [scores["per_class"][name]["f1"] for name in names]
        legend = f"{label} (micro-F1 {scores['micro_f1']:.3f}, macro-F1 {scores['macro_f1']:.3f})" \
            if "micro_f1" in scores else label
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=legend)
        ax.bar_label(bars, fmt="%.2f", fontsize=6 if len(series) > 2 else 7, padding=1,
                     rotation=90 if len(series) > 2 else 0)
    if reference:
        shown = [(i, reference[name]) for i, name in enumerate(names) if name in reference]
        if shown:
            ax.scatter([i for i, _ in shown], [v for _, v in shown], marker="_", s=900, linewidths=2.5,
                       color="black", zorder=3, label=reference_label)
    ax.set_xticks(x, [f"{name}\n(n={first['per_class'][name]['support']})" for name in names], fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("F1")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=8, frameon=False)
    ax.set_title(title or "Per-class F1")
    return fig


def plot_per_class_f1(path: str | os.PathLike, results: Mapping, title: str | None = None,
                      reference: Mapping[str, float] | None = None, reference_label: str = "published") -> Path:
    """Save ``per_class_f1_figure`` (PNG unless the suffix names another format), atomically."""
    return atomic_write_figure(path, per_class_f1_figure(results, title, reference, reference_label), dpi=120)


def plot_dev_per_class_f1(path: str | os.PathLike, results: Mapping, label_names: Sequence[str], title: str) -> Path:
    """``plot_per_class_f1`` of a classifier's dev scores, with Kant et al.'s published E-c test values marked
    when its labels are E-c's (or a subset of them)."""
    published = PUBLISHED_EC_TEST_F1 if set(label_names) <= set(SEMEVAL_EC_LABELS) else None
    return plot_per_class_f1(path, results, reference=published,
                             reference_label="Kant et al. 2018, E-c test (the values the paper gives)", title=title)


def format_comparison(systems: Mapping[str, Mapping], per_class: bool = True) -> str:
    """Plain-text tables putting systems side by side; ``systems`` maps a name to a ``multilabel_scores``
    dict. First one row per system (micro-F1, macro-F1, Jaccard), then (``per_class``) one row per class
    with each system's F1 under its number from the first table."""
    names = list(systems)
    summary = [[f"[{i + 1}]", name, *(f"{systems[name][key]:.3f}" for key in ("micro_f1", "macro_f1", "jaccard"))]
               for i, name in enumerate(names)]
    out = [_table(["#", "system", "micro-F1", "macro-F1", "Jaccard"], summary)]
    if per_class:
        classes = list(dict.fromkeys(c for name in names for c in systems[name]["per_class"]))
        rows = [[c, str(systems[names[0]]["per_class"].get(c, {}).get("support", ""))] +
                [f"{systems[name]['per_class'][c]['f1']:.3f}" if c in systems[name]["per_class"] else "-"
                 for name in names] for c in classes]
        out.append(_table(["F1 per class", "support", *(f"[{i + 1}]" for i in range(len(names)))], rows))
    return "\n\n".join(out)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    text_cols = {0, 1} if header[1] == "system" else {0}

    def fmt(row):
        return "  ".join(v.ljust(w) if i in text_cols else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _series(results: Mapping) -> dict:
    if AT_HALF in results or TUNED in results:
        shown = {AT_HALF: "threshold 0.5", TUNED: "tuned thresholds"}
        return {shown[key]: results[key] for key in (AT_HALF, TUNED) if key in results}
    if results and all(isinstance(v, Mapping) and "per_class" in v for v in results.values()):
        return dict(results)
    if "per_class" in results:
        return {"F1": results}
    raise ValueError("expected evaluate_probabilities() output, a multilabel_scores() dict, or a mapping of "
                     "system names to such dicts")


def _check_binary(y_true, y_pred) -> tuple[np.ndarray, np.ndarray]:
    y, p = np.asarray(y_true), np.asarray(y_pred)
    if y.ndim != 2 or y.shape != p.shape:
        raise ValueError(f"gold {list(y.shape)} and predictions {list(p.shape)} must both be [n, num_labels]")
    for name, a in (("gold", y), ("predictions", p)):
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"{name} must be 0/1 (threshold probabilities with apply_thresholds first)")
    return y.astype(np.int8), p.astype(np.int8)


def _names(label_names, k: int) -> list[str]:
    if label_names is None:
        return [f"label_{j}" for j in range(k)]
    if len(label_names) != k:
        raise ValueError(f"{len(label_names)} label names for {k} label columns")
    return list(label_names)


def _plain(obj):
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, np.generic):
        return _plain(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"eval.json cannot hold {obj} (not finite)")
    if isinstance(obj, Path):
        return str(obj)
    return obj
