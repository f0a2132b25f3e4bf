"""The sentiment neuron: a sparse linear probe on a byte-level mLSTM's features (Radford et al. 2017).

Each text is read byte by byte from a zero state; its feature vector is the final cell state
(``MLSTM.features``). An L1-penalised logistic regression on the (train-standardised) features
is fitted on the train split with C chosen on the validation split, and scored on test. The
single most predictive unit is the one whose best threshold classifies the train split best;
its polarity and threshold are chosen on train and its accuracy reported on val and test,
with a plot of its values by class (``python -m pipeline.sentiment_neuron``).
"""
from __future__ import annotations

import csv
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from tqdm import tqdm

from pipeline.job.files import atomic_path, atomic_write_json

SPLITS = ("train", "val", "test")
DEFAULT_CS = tuple(2.0 ** k for k in range(-6, 4))


# -- data ------------------------------------------------------------------------------
def read_tsv(path: str | Path, limit: int | None = None) -> tuple[list[str], np.ndarray]:
    """(texts, 0/1 labels) from a ``sentence<TAB>label`` file; errors name the file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    texts, labels = [], []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header != ["sentence", "label"]:
            raise ValueError(f"{path}:1: expected the header 'sentence<TAB>label', got {header!r}")
        for row in reader:
            line = reader.line_num
            if len(row) != 2:
                raise ValueError(f"{path}:{line}: expected 2 tab-separated fields (sentence, label), got {len(row)}")
            if row[1] not in ("0", "1"):
                raise ValueError(f"{path}:{line}: label must be 0 or 1, got {row[1]!r}")
            if not row[0]:
                raise ValueError(f"{path}:{line}: empty sentence")
            texts.append(row[0])
            labels.append(int(row[1]))
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path}: no examples")
    return texts, np.asarray(labels, dtype=np.int64)


def encode_bytes(text: str, max_length: int | None = None) -> list[int]:
    """Token ids of a byte-level model: the UTF-8 bytes (byte b is id b)."""
    ids = list(text.encode("utf-8"))
    return ids[:max_length] if max_length else ids


# -- features --------------------------------------------------------------------------
@torch.no_grad()
def featurize(model, texts: list[str], batch_size: int = 64, max_length: int | None = None,
              progress: bool = True) -> np.ndarray:
    """Final cell state of every text, [n, hidden] float32. Texts are batched by length (little padding)."""
    encoded = [encode_bytes(t, max_length) for t in texts]
    if any(not e for e in encoded):
        raise ValueError("every text needs at least one byte")
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = np.empty((len(texts), model.config.hidden_size), dtype=np.float32)
    batches = range(0, len(order), batch_size)
    if progress:
        batches = tqdm(batches, desc="features", unit="batch", leave=False)
    try:
        for start in batches:
            idx = order[start:start + batch_size]
            lengths = torch.tensor([len(encoded[i]) for i in idx])
            ids = torch.zeros(len(idx), int(lengths.max()), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(encoded[i])] = torch.tensor(encoded[i])
            feats = model.features(ids.to(device), lengths.to(device))
            out[idx] = feats.float().cpu().numpy()
    finally:
        model.train(was_training)
    return out


# -- probes ----------------------------------------------------------------------------
def best_thresholds(x: np.ndarray, y: np.ndarray, chunk: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every column of x [n, d]: the threshold and polarity that classify y best on x itself.

    Prediction is ``polarity * (x - threshold) > 0``. Returns (accuracy [d], threshold [d],
    polarity [d] in {+1, -1}). Exhaustive over the n+1 cut points, vectorised over ``chunk`` columns.
    """
    if x.shape[1] > chunk:
        parts = [best_thresholds(x[:, i:i + chunk], y, chunk) for i in range(0, x.shape[1], chunk)]
        return tuple(np.concatenate(p) for p in zip(*parts))
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")
    xs = np.take_along_axis(x, order, axis=0)
    ys = y[order]                                                  # labels in each column's sorted order
    pos_below = np.vstack([np.zeros((1, x.shape[1])), np.cumsum(ys, axis=0)])   # positives among the k lowest
    k = np.arange(n + 1)[:, None]
    total_pos = ys.sum(axis=0, keepdims=True)
    # Cut after the k lowest values: "above is positive" is right for the negatives below and positives above.
    acc_up = ((k - pos_below) + (total_pos - pos_below)) / n
    acc = np.maximum(acc_up, 1.0 - acc_up)
    # Only cut between distinct values (a cut inside a run of equal values cannot be realised).
    valid = np.ones((n + 1, x.shape[1]), dtype=bool)
    valid[1:n] = xs[1:] != xs[:-1]
    acc = np.where(valid, acc, -1.0)
    best_k = acc.argmax(axis=0)
    cols = np.arange(x.shape[1])
    lo = np.where(best_k > 0, xs[np.maximum(best_k - 1, 0), cols], -np.inf)
    hi = np.where(best_k < n, xs[np.minimum(best_k, n - 1), cols], np.inf)
    threshold = np.where(np.isinf(lo), hi - 1.0, np.where(np.isinf(hi), lo + 1.0, (lo + hi) / 2))
    polarity = np.where(acc_up[best_k, cols] >= 0.5, 1, -1)
    return acc[best_k, cols], threshold, polarity


def unit_accuracy(values: np.ndarray, y: np.ndarray, threshold: float, polarity: int) -> float:
    return float(((polarity * (values - threshold) > 0).astype(np.int64) == y).mean())


def fit_l1_probe(features: dict, labels: dict, Cs=DEFAULT_CS, seed: int = 0):
    """L1 logistic regression on train-standardised features, C chosen on val. -> (model, scaler, info)."""
    scaler = StandardScaler().fit(features["train"])
    X = {k: scaler.transform(v) for k, v in features.items()}
    best = None
    for C in Cs:
        clf = LogisticRegression(C=C, l1_ratio=1.0, solver="liblinear", max_iter=1000, random_state=seed)
        clf.fit(X["train"], labels["train"])
        val = clf.score(X["val"], labels["val"])
        if best is None or val > best[0]:
            best = (val, C, clf)
    val, C, clf = best
    info = {"C": C, "nonzero_units": int((clf.coef_ != 0).sum()),
            **{f"{k}_accuracy": float(clf.score(X[k], labels[k])) for k in SPLITS}}
    return clf, scaler, info


# -- the whole experiment ----------------------------------------------------------------
def plot_unit(values: dict, labels: dict, unit: int, threshold: float, path: Path, split: str = "test") -> None:
    matplotlib.use("Agg")
    v, y = values[split], labels[split]
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(v.min(), v.max(), 50)
    ax.hist(v[y == 0], bins=bins, alpha=0.6, label=f"negative (n={int((y == 0).sum())})", color="tab:red")
    ax.hist(v[y == 1], bins=bins, alpha=0.6, label=f"positive (n={int((y == 1).sum())})", color="tab:blue")
    ax.axvline(threshold, color="k", linestyle="--", label=f"threshold {threshold:.3g} (chosen on train)")
    ax.set_xlabel(f"cell state of unit {unit} after the last byte")
    ax.set_ylabel(f"{split} texts")
    ax.set_title(f"Most predictive unit {unit} by class ({split})")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def run_sentiment_neuron(model, data_dir: str | Path, out_dir: str | Path, batch_size: int = 64,
                         max_length: int | None = None, limit: int | None = None, Cs=DEFAULT_CS,
                         progress: bool = True, model_name: str | None = None) -> dict:
    """Features -> L1 probe -> single best unit -> results.json and a PNG in ``out_dir``. Returns the results."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts, labels = {}, {}
    for split in SPLITS:
        texts[split], labels[split] = read_tsv(data_dir / f"{split}.tsv", limit)
    t0 = time.time()
    features = {s: featurize(model, texts[s], batch_size, max_length, progress) for s in SPLITS}
    seconds = time.time() - t0
    clf, scaler, probe = fit_l1_probe(features, labels, Cs)

    acc, thresholds, polarities = best_thresholds(features["train"], labels["train"])
    unit = int(acc.argmax())
    threshold, polarity = float(thresholds[unit]), int(polarities[unit])
    values = {s: features[s][:, unit] for s in SPLITS}
    single = {"unit": unit, "polarity": polarity, "threshold": threshold,
              **{f"{s}_accuracy": unit_accuracy(values[s], labels[s], threshold, polarity) for s in SPLITS}}
    weights = np.abs(clf.coef_[0])
    plot_path = out_dir / f"unit_{unit}.png"
    plot_unit(values, labels, unit, threshold, plot_path)
    results = {
        "model": model_name, "hidden_size": model.config.hidden_size, "data_dir": str(data_dir),
        "examples": {s: len(texts[s]) for s in SPLITS}, "feature_seconds": round(seconds, 2),
        "l1_probe": probe, "single_unit": single,
        "largest_l1_weight_unit": int(weights.argmax()) if weights.any() else None,
        "majority_class_test_accuracy": float(max(labels["test"].mean(), 1 - labels["test"].mean())),
        "plot": plot_path.name,
    }
    atomic_write_json(out_dir / "results.json", results)
    return results
