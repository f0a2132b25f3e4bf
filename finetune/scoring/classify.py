"""What ``finetune.predict`` does with its parsed arguments (the command parses them without loading torch): the
predictor's probabilities for a file of texts, decided by its thresholds, written as E-c predictions and scored when
the file is labelled."""
from __future__ import annotations

import time

import numpy as np

from finetune._io import atomic_write_text
from finetune.data import read_texts
from finetune.ensemble.predictor import load_predictor
from finetune.scoring.metrics import evaluate_probabilities, format_comparison, single_label_scores, write_eval_json
from finetune.scoring.predictions import write_predictions
from finetune.scoring.thresholds import apply_thresholds
from pipeline.hf.convert import parse_dtype

__all__ = ["classify_file"]


def classify_file(args) -> dict:
    """The predictions (and scores) of ``args.model`` on ``args.data``, written to ``args.out``."""
    clf = load_predictor(args.model, dtype=parse_dtype(args.dtype))
    data = read_texts(args.data, clf.label_names, args.text_column, args.id_column)
    names = clf.label_names
    t0 = time.perf_counter()
    probs = clf.predict_proba(data.texts, batch_size=args.batch_size, progress=True)
    seconds = time.perf_counter() - t0
    if clf.multilabel:
        thresholds = np.full(len(names), args.threshold) if args.threshold is not None else (
            clf.thresholds if clf.thresholds is not None else np.full(len(names), 0.5))
        predictions = apply_thresholds(probs, thresholds)
    else:
        thresholds = None
        predictions = np.eye(len(names), dtype=np.int8)[probs.argmax(axis=1)]
    write_predictions(args.out, data.ids, data.texts, predictions, names)
    print(f"wrote predictions for {len(data)} texts to {args.out} ({len(data) / seconds:.1f} texts/s, batches "
          f"sorted by length)")
    if args.probabilities:
        rows = ["\t".join(["ID", *names])] + ["\t".join([i, *(f"{p:.6f}" for p in row)])
                                              for i, row in zip(data.ids, probs)]
        atomic_write_text(args.probabilities, "\n".join(rows) + "\n")
    result = {"n": len(data), "predictions": predictions, "probabilities": probs,
              "texts_per_second": len(data) / seconds}
    if data.labels is not None:
        if clf.multilabel:
            scores = evaluate_probabilities(data.labels, probs, names, thresholds)
            shown = {"threshold 0.5": scores["at_0.5"],
                     "given threshold" if args.threshold is not None else "tuned thresholds": scores["tuned"]}
            print(f"scores on {args.data} ({len(data)} texts):\n" + format_comparison(shown))
        else:
            scores = {"single_label": single_label_scores(data.class_indices(), probs.argmax(1), names)}
            s = scores["single_label"]
            print(f"scores on {args.data}: accuracy {s['accuracy']:.4f}, macro-F1 {s['macro_f1']:.4f}")
        if args.eval_json:
            write_eval_json(args.eval_json, scores, model=str(args.model), data=str(args.data))
        result["scores"] = scores
    return result
