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
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the project root, not finetune/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pipeline.job.arguments import add_dtype_arg
from pipeline.job.errors import ArgumentParser, job_command
from pipeline.job.files import check_output_file, refuse_overlap
from pipeline.job.numbers import positive_int, probability


def parse_args(argv=None):
    p = ArgumentParser(prog="mds-predict", description=__doc__)
    p.add_argument("--model", required=True, help="classifier directory (finetune/train.py --save) or ensemble "
                                                  "(python -m finetune.ensemble --save)")
    p.add_argument("--data", required=True, help="texts to classify (E-c file, or CSV/TSV/JSON(L))")
    p.add_argument("--out", required=True, help="predictions file to write (E-c format)")
    p.add_argument("--text-column", default=None, help="text column of a non-E-c file (default 'text')")
    p.add_argument("--id-column", default=None, help="ID column of a non-E-c file (default: row numbers)")
    p.add_argument("--threshold", type=probability(), default=None, help="one threshold for every label instead of the "
                                                                 "tuned ones")
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward")
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
    return args


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


def _job():
    from finetune.scoring.classify import classify_file  # noqa: PLC0415  (deferred: --help must not load torch)
    return classify_file


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
