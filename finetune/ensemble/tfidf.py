"""The TF-IDF + logistic-regression classifier (scikit-learn), saved without pickle so it can serve as a member
of an ensemble (``finetune.ensemble``) and be loaded from a directory a user hands in.

The model: word 1-2-grams and character 2-5-grams (sublinear tf, min_df 2, l2-normalised, concatenated) ->
one logistic regression per label (class-balanced, liblinear). It is fitted by scikit-learn; what is saved is
each vectorizer's vocabulary and idf (``tfidf.json``) and the regression weights (``tfidf.safetensors``).
Loading rebuilds the same transform from those numbers (a fixed-vocabulary ``CountVectorizer``, then tf, idf and
the row norm as ``TfidfTransformer`` computes them) and one sigmoid per label: scikit-learn's probabilities,
without unpickling anything.

    clf = TfidfClassifier.fit(texts, labels, label_names, normalizer=TweetNormalizer())
    clf.save("runs/ec-ensemble/members/tfidf")
    probs = TfidfClassifier.load("runs/ec-ensemble/members/tfidf").predict_proba(texts)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import scipy.sparse as sp
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from scipy.special import expit
from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier
from sklearn.pipeline import make_pipeline, make_union
from sklearn.preprocessing import normalize
from threadpoolctl import threadpool_limits

from pipeline.job.errors import UserError
from pipeline.job.files import atomic_path, atomic_write_text

from finetune.normalize import TweetNormalizer

TFIDF_FILE = "tfidf.json"
WEIGHTS_FILE = "tfidf.safetensors"
FORMAT = "finetune.tfidf/v1"
_COUNT_PARAMS = ("analyzer", "ngram_range", "lowercase", "token_pattern", "strip_accents")
_TFIDF_PARAMS = ("sublinear_tf", "norm", "use_idf")


class TfidfDirError(UserError, ValueError):
    pass


def build_model(C: float = 1.0, class_weight: str | None = "balanced", n_jobs: int = 1):
    """TF-IDF word 1-2-grams + char 2-5-grams (sublinear tf, min_df 2) -> one logistic regression per label."""
    features = make_union(
        TfidfVectorizer(analyzer="word", ngram_range=(1, 2), min_df=2, sublinear_tf=True),
        TfidfVectorizer(analyzer="char", ngram_range=(2, 5), min_df=2, sublinear_tf=True))
    classifier = OneVsRestClassifier(LogisticRegression(C=C, class_weight=class_weight, solver="liblinear",
                                                        max_iter=1000), n_jobs=n_jobs)
    return make_pipeline(features, classifier)


@dataclass
class _Features:
    """One vectorizer as numbers: its parameters, vocabulary (term of each column) and idf."""
    params: dict
    vocabulary: list[str]
    idf: np.ndarray | None

    def transform(self, texts: Sequence[str]) -> sp.csr_matrix:
        count = {k: tuple(v) if k == "ngram_range" else v for k, v in self.params.items() if k in _COUNT_PARAMS}
        x = CountVectorizer(vocabulary={t: i for i, t in enumerate(self.vocabulary)}, dtype=np.float64,
                            **count).transform(texts).tocsr()
        if self.params["sublinear_tf"]:
            np.log(x.data, x.data)
            x.data += 1
        if self.idf is not None:
            x = x @ sp.diags(self.idf)
        return normalize(x, norm=self.params["norm"], copy=False) if self.params["norm"] else x


@dataclass
class TfidfClassifier:
    features: list[_Features]
    coef: np.ndarray        # [k, features]
    intercept: np.ndarray   # [k]
    label_names: list[str]
    normalizer: TweetNormalizer | None
    training: dict = field(default_factory=dict)  # the training file and held-out split it was fitted on
    thresholds: np.ndarray | None = None
    directory: Path | None = None
    multilabel: bool = True

    @classmethod
    def fit(cls, texts: Sequence[str], labels: np.ndarray, label_names: Sequence[str], *,
            normalizer: TweetNormalizer | None = None, training: dict | None = None,
            **model_kwargs) -> "TfidfClassifier":
        """Fit scikit-learn's model (``build_model``) on ``texts`` [n] and 0/1 ``labels`` [n, k]."""
        texts = [normalizer(t) for t in texts] if normalizer is not None else list(texts)
        with threadpool_limits(limits=1):  # sparse liblinear gains nothing from BLAS threads
            model = build_model(**model_kwargs).fit(texts, labels)
        union, ovr = model.steps[0][1], model.steps[1][1]
        features = []
        for _, vec in union.transformer_list:
            params = vec.get_params()
            vocab = sorted(vec.vocabulary_, key=vec.vocabulary_.get)
            features.append(_Features({k: params[k] for k in (*_COUNT_PARAMS, *_TFIDF_PARAMS)}, vocab,
                                      vec.idf_ if params["use_idf"] else None))
        n = sum(len(f.vocabulary) for f in features)
        coef, intercept = np.zeros((len(label_names), n)), np.zeros(len(label_names))
        for j, est in enumerate(ovr.estimators_):
            if hasattr(est, "coef_"):
                coef[j], intercept[j] = est.coef_[0], est.intercept_[0]
            else:  # a label with one class in training: scikit-learn's constant predictor
                intercept[j] = 50.0 if est.y_.ravel()[0] else -50.0
        return cls(features, coef, intercept, list(label_names), normalizer, dict(training or {}))

    def predict_proba(self, texts: Sequence[str], batch_size: int | None = None, progress: bool = False) -> np.ndarray:
        """Probabilities float32 [n, k] (``batch_size`` and ``progress``: the neural classifiers' signature)."""
        texts = [self.normalizer(t) for t in texts] if self.normalizer is not None else list(texts)
        x = sp.hstack([f.transform(texts) for f in self.features]).tocsr()
        return expit(np.asarray(x @ self.coef.T) + self.intercept).astype(np.float32)

    def save(self, directory: str | os.PathLike) -> Path:
        """Complete-or-invisible: the weights first, ``tfidf.json`` (which names them) last, both atomic."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / TFIDF_FILE).unlink(missing_ok=True)
        tensors = {"coef": self.coef, "intercept": self.intercept}
        tensors.update({f"idf_{i}": f.idf for i, f in enumerate(self.features) if f.idf is not None})
        with atomic_path(d / WEIGHTS_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"content": FORMAT})
        info = {"format": FORMAT, "label_names": self.label_names,
                "normalizer": None if self.normalizer is None else self.normalizer.to_dict(),
                "training": self.training,
                "features": [{"params": f.params, "vocabulary": f.vocabulary} for f in self.features]}
        atomic_write_text(d / TFIDF_FILE, json.dumps(info, ensure_ascii=False) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "TfidfClassifier":
        d = Path(directory)
        try:
            info = json.loads((d / TFIDF_FILE).read_text(encoding="utf-8"))
            tensors = load_file(str(d / WEIGHTS_FILE))
        except FileNotFoundError as e:
            raise TfidfDirError(f"{d} is not a TF-IDF classifier directory: no {Path(e.filename).name}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise TfidfDirError(f"{d}: unreadable TF-IDF classifier ({type(e).__name__}: {e})") from None
        except SafetensorError as e:  # a pickle or anything else in its place: never unpickled
            raise TfidfDirError(f"{d / WEIGHTS_FILE}: not a safetensors file ({e}); retrain the TF-IDF member with "
                                f"python -m finetune.ensemble") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise TfidfDirError(f"{d / TFIDF_FILE}: format is not {FORMAT!r}")
        try:
            features = [_Features(f["params"], f["vocabulary"], tensors.get(f"idf_{i}"))
                        for i, f in enumerate(info["features"])]
            coef, intercept, names = tensors["coef"], tensors["intercept"], [str(n) for n in info["label_names"]]
            normalizer = None if info["normalizer"] is None else TweetNormalizer.from_dict(info["normalizer"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TfidfDirError(f"{d}: {TFIDF_FILE} or {WEIGHTS_FILE} is malformed ({type(e).__name__}: {e}); "
                                f"retrain the TF-IDF member with python -m finetune.ensemble") from None
        if coef.shape != (len(names), sum(len(f.vocabulary) for f in features)) or intercept.shape != (len(names),):
            raise TfidfDirError(f"{d / WEIGHTS_FILE}: weights {tuple(coef.shape)} do not match {len(names)} labels "
                                f"and the vocabularies in {TFIDF_FILE}")
        return cls(features, coef, intercept, names, normalizer, info.get("training", {}), directory=d)
