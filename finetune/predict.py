"""Classify a file of texts with a finetuned classifier or an ensemble (``finetune.ensemble``); write the
predictions in the official E-c format.

    python -m finetune.predict --model runs/ec --data E-c-En-test.txt --out E-C_en_pred.txt

``--data``: an E-c file (labelled with 0/1, or unlabelled with NONE in every label cell, as the official test
file before the gold release), or any CSV/TSV/JSON(L) file with ``--text-column`` (and ``--id-column``).
The model's tuned thresholds decide each label (``--threshold`` sets one for all instead). When the file
holds the model's labels, the scores at 0.5 and at the thresholds are printed too (and written with
``--eval-json``). Texts are normalised and tokenised as in training. ``--probabilities FILE`` also writes
each text's probabilities (TSV: ID then one column per label).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the project root, not finetune/
    sys.path[0] = str(Path(__file__).resolve().parents[1])


import numpy as np

from finetune._io import atomic_write_text
from finetune.data import read_texts
from finetune.ensemble import load_predictor
from finetune.scoring.metrics import evaluate_probabilities, format_comparison, single_label_scores, write_eval_json
from finetune.scoring.predictions import write_predictions
from finetune.scoring.thresholds import apply_thresholds
from pipeline.hf.convert import add_dtype_arg, parse_dtype
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.files import check_output_file, refuse_overlap
from pipeline.job.numbers import positive_int, probability


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m finetune.predict", description=__doc__)
    p.add_argument("--model", required=True, help="classifier directory (finetune/train.py --save) or ensemble "
                                                  "(python -m finetune.ensemble --save)")
    p.add_argument("--data", required=True, help="texts to classify (E-c file, or CSV/TSV/JSON(L))")
    p.add_argument("--out", required=True, help="predictions file to write (E-c format)")
    p.add_argument("--text-column", default=None, help="text column of a non-E-c file (default 'text')")
    p.add_argument("--id-column", default=None, help="ID column of a non-E-c file (default: row numbers)")
    p.add_argument("--threshold", type=probability(), default=None, help="one threshold for every label instead of the "
                                                                 "tuned ones")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_dtype_arg(p, help="dtype the classifier computes in (bfloat16: about 3x faster on a CPU with bf16 units)")
    p.add_argument("--probabilities", default=None, help="also write the probabilities to this TSV file")
    p.add_argument("--eval-json", default=None, help="write the scores to this JSON file (labelled data)")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    check_outputs(args)
    if args.threshold is not None and not 0.0 < args.threshold < 1.0:
        p.error(f"--threshold must be in (0, 1), got {args.threshold}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return p, args


def check_outputs(args) -> None:
    """Before any work: no output replaces an input (ever) or an existing file (unless --force), and the
    outputs are distinct files."""
    outputs = [(flag, getattr(args, attr)) for flag, attr in (("--out", "out"), ("--probabilities", "probabilities"),
                                                              ("--eval-json", "eval_json"))
               if getattr(args, attr) is not None]
    inputs = [("--data", args.data), ("--model", args.model)]
    for i, (flag, path) in enumerate(outputs):
        refuse_overlap(path, inputs + outputs[:i], flag)
        check_output_file(path, args.force, flag)


@command
def main(argv=None) -> dict:
    parser, args = parse_args(argv)

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


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
