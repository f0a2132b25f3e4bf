"""The sentiment neuron: a sparse linear probe on a byte-level mLSTM's features (Radford et al. 2017).

Each text is read byte by byte from a zero state; its feature vector is the final cell state
(``MLSTM.features``). An L1-penalised logistic regression on the (train-standardised) features
is fitted on the train split with C chosen on the validation split, and scored on test. The
single most predictive unit is the one whose best threshold classifies the train split best;
its polarity and threshold are chosen on train and its accuracy reported on val and test,
with a plot of its values by class.

    python -m pipeline.sentiment_neuron --model DIR --data-dir DIR --out DIR

``--model``: a directory with ``config.json`` + ``model.safetensors`` (``models.mlstm.save_mlstm``).
``--data-dir``: ``train.tsv``, ``val.tsv``, ``test.tsv``, each with the header ``sentence<TAB>label``
and 0/1 labels (binary SST-2 as distributed with sentiment-discovery).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from models.mlstm import MLSTM, load_mlstm
from pipeline.checkpoints.checkpoint import is_deepspeed_run_dir, read_full_checkpoint
from pipeline.job.errors import ArgumentParser, command
from pipeline.job.numbers import positive_int
from pipeline.evaluation.sentiment_neuron import DEFAULT_CS, run_sentiment_neuron


def parse_args(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="directory with config.json + model.safetensors (save_mlstm)")
    ap.add_argument("--data-dir", required=True, help="directory with train.tsv, val.tsv, test.tsv")
    ap.add_argument("--out", required=True, help="output directory (results.json, unit_<i>.png)")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--max-length", type=positive_int, default=None, help="truncate texts to this many bytes")
    ap.add_argument("--limit", type=positive_int, default=None,
                    help="use only the first N examples of each split (smoke runs)")
    ap.add_argument("--Cs", default=",".join(f"{c:g}" for c in DEFAULT_CS),
                    help="comma-separated C grid for the L1 probe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


@command
def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_deepspeed_run_dir(args.model):  # a pretraining run of the main job (--model-type mlstm)
        config, state, _ = read_full_checkpoint(args.model)
        model = MLSTM(config)
        model.load_state_dict(state)
        model.to(args.device)
    else:
        model = load_mlstm(args.model, map_location=args.device)
    Cs = [float(c) for c in args.Cs.split(",")]
    r = run_sentiment_neuron(model, args.data_dir, args.out, args.batch_size, args.max_length, args.limit, Cs,
                             progress=not args.no_progress, model_name=str(args.model))
    p, u = r["l1_probe"], r["single_unit"]
    print(f"L1 probe (C={p['C']:g}, {p['nonzero_units']} of {r['hidden_size']} units): "
          f"test accuracy {p['test_accuracy']:.4f} (val {p['val_accuracy']:.4f})")
    print(f"single unit {u['unit']} (polarity {u['polarity']:+d}, threshold {u['threshold']:.4g}): "
          f"test accuracy {u['test_accuracy']:.4f} (val {u['val_accuracy']:.4f}); "
          f"majority class {r['majority_class_test_accuracy']:.4f}")
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / r['plot']}")
    return r



def cli() -> int:
    """The console script (pyproject.toml)."""
    return 0 if main() else 1


if __name__ == "__main__":
    sys.exit(cli())
