"""scikit-learn baseline on SemEval-2018 E-c dev: TF-IDF word (1-2) and character (2-5) n-grams, one-vs-rest
logistic regression, per-class thresholds.

Thresholds are tuned honestly, on out-of-fold probabilities of a K-fold cross-validation over train
(never on dev), then the model refit on all of train scores dev. For reference only, thresholds tuned on
dev itself are reported too (optimistic: tuned and scored on the same tweets). Two tunings each:
per-class F1 (what maximises macro-F1) and per-class then micro-F1 refinement (``refine="micro"``, the
project's default, which maximises micro-F1 and Jaccard at some cost in macro-F1).

    python bench/emotion_baseline.py [--train ...] [--dev ...] [--out-dir bench/results] [--folds 5] [--C 1]

Reusable by other benchmarks (run from bench/, or with bench/ on sys.path):

    from emotion_baseline import run_baseline
    from finetune.scoring.metrics import evaluate_probabilities, format_comparison
    base = run_baseline(train, dev)                                   # LabeledTexts of finetune.data
    ours = evaluate_probabilities(dev.labels, dev_probs, dev.label_names, thresholds)["tuned"]
    print(format_comparison({**base["systems"], "project": ours}))
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sklearn.model_selection import KFold
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from finetune.data import LabeledTexts, load_semeval_ec  # noqa: E402
from finetune.ensemble.tfidf import build_model  # noqa: E402  (the model finetune.ensemble serves)
from finetune.scoring.metrics import evaluate_probabilities, format_comparison, plot_per_class_f1, write_eval_json  # noqa: E402
from finetune.normalize import TweetNormalizer  # noqa: E402
from finetune.scoring.thresholds import tune_thresholds  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "semeval2018-ec"


def out_of_fold_probabilities(texts: list[str], labels: np.ndarray, folds: int = 5, seed: int = 0,
                              **model_kwargs) -> np.ndarray:  # model_kwargs: those of build_model
    """Probabilities [n, k] for every training text from a model that did not see it (K-fold)."""

    probs = np.zeros(labels.shape, dtype=np.float64)
    splits = KFold(folds, shuffle=True, random_state=seed).split(texts)
    for fit_idx, held_idx in tqdm(list(splits), desc="cross-validation folds", leave=False):
        model = build_model(**model_kwargs).fit([texts[i] for i in fit_idx], labels[fit_idx])
        probs[held_idx] = model.predict_proba([texts[i] for i in held_idx])
    return probs


def run_baseline(train: LabeledTexts, dev: LabeledTexts, *, normalizer: TweetNormalizer | None = TweetNormalizer(),
                 folds: int = 5, seed: int = 0, C: float = 1.0, class_weight: str | None = "balanced",
                 n_jobs: int = 1) -> dict:
    """Fit on train, score dev. Returns {"systems": {name: multilabel_scores}, "thresholds": {name: [k]},
    "dev_probabilities": [n, k], "seconds": {...}, "settings": {...}}."""

    # Sparse features and liblinear gain nothing from BLAS threads, and idle OpenMP/BLAS threads spinning on a
    # busy machine made this ~10x slower: one thread per process (parallelism is n_jobs).
    with threadpool_limits(limits=1):
        return _run_baseline(train, dev, normalizer=normalizer, folds=folds, seed=seed, C=C,
                             class_weight=class_weight, n_jobs=n_jobs)


def _run_baseline(train, dev, *, normalizer, folds, seed, C, class_weight, n_jobs) -> dict:
    if train.label_names != dev.label_names:
        raise ValueError(f"train labels {train.label_names} differ from dev labels {dev.label_names}")
    if normalizer is not None:
        train, dev = train.map_texts(normalizer), dev.map_texts(normalizer)
    names = dev.label_names
    model_kwargs = dict(C=C, class_weight=class_weight, n_jobs=n_jobs)
    t0 = time.perf_counter()
    model = build_model(**model_kwargs).fit(train.texts, train.labels)
    dev_probs = model.predict_proba(dev.texts)
    t_fit = time.perf_counter() - t0
    oof = out_of_fold_probabilities(train.texts, train.labels, folds=folds, seed=seed, **model_kwargs)
    t_cv = time.perf_counter() - t0 - t_fit

    thresholds = {
        "thresholds per-class F1, CV on train": tune_thresholds(train.labels, oof, refine=None),
        "thresholds per-class + micro-F1, CV on train": tune_thresholds(train.labels, oof, refine="micro"),
        "thresholds per-class F1, tuned on dev (optimistic)": tune_thresholds(dev.labels, dev_probs, refine=None),
        "thresholds per-class + micro-F1, tuned on dev (optimistic)":
            tune_thresholds(dev.labels, dev_probs, refine="micro"),
    }
    systems = {"threshold 0.5": evaluate_probabilities(dev.labels, dev_probs, names)["at_0.5"]}
    for name, t in thresholds.items():
        systems[name] = evaluate_probabilities(dev.labels, dev_probs, names, t)["tuned"]
    return {
        "systems": {f"tf-idf+LR, {name}": scores for name, scores in systems.items()},
        "thresholds": {f"tf-idf+LR, {name}": dict(zip(names, t.tolist())) for name, t in thresholds.items()},
        "dev_probabilities": dev_probs,
        "seconds": {"fit_train_predict_dev": t_fit, f"{folds}_fold_cv": t_cv},
        "settings": {"folds": folds, "seed": seed, "C": C, "class_weight": class_weight,
                     "normalizer": None if normalizer is None else normalizer.to_dict(),
                     "train": train.source, "dev": dev.source, "labels": list(names)},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", default=str(DATA / "train.tsv"))
    parser.add_argument("--dev", default=str(DATA / "dev.tsv"))
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--C", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="parallel one-vs-rest fits")
    args = parser.parse_args(argv)

    train, dev = load_semeval_ec(args.train), load_semeval_ec(args.dev)
    result = run_baseline(train, dev, folds=args.folds, seed=args.seed, C=args.C, n_jobs=args.jobs)
    print(f"SemEval-2018 E-c dev ({len(dev)} tweets), trained on {len(train)}; "
          f"fit {result['seconds']['fit_train_predict_dev']:.1f}s, "
          f"{args.folds}-fold CV {result['seconds'][f'{args.folds}_fold_cv']:.1f}s")
    print(format_comparison(result["systems"]))
    out = Path(args.out_dir)
    doc = {k: v for k, v in result.items() if k != "dev_probabilities"}
    print("wrote", write_eval_json(out / "emotion_baseline.json", doc, benchmark="emotion_baseline"))
    honest = {name: s for name, s in result["systems"].items() if "optimistic" not in name}
    print("wrote", plot_per_class_f1(out / "emotion_baseline_per_class_f1.png", honest,
                                     title="TF-IDF + logistic regression baseline, E-c dev"))


if __name__ == "__main__":
    main()
