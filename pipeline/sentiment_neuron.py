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

from pipeline.job.errors import ArgumentParser, command
from pipeline.job.numbers import positive_int


def parse_args(argv=None):
    ap = ArgumentParser(prog="mds-sentiment-neuron", description=__doc__)
    ap.add_argument("--model", required=True, help="directory with config.json + model.safetensors (save_mlstm)")
    ap.add_argument("--data-dir", required=True, help="directory with train.tsv, val.tsv, test.tsv")
    ap.add_argument("--out", required=True, help="output directory (results.json, unit_<i>.png)")
    ap.add_argument("--batch-size", type=positive_int, default=64, help="texts read together")
    ap.add_argument("--max-length", type=positive_int, default=None, help="truncate texts to this many bytes")
    ap.add_argument("--limit", type=positive_int, default=None,
                    help="use only the first N examples of each split (smoke runs)")
    ap.add_argument("--Cs", default=None, help="comma-separated C grid for the L1 probe (default: 2^-6 ... 2^3)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... or auto: cuda if there is one")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


@command
def main(argv=None) -> dict:
    args = parse_args(argv)
    from pipeline.evaluation.run import probe_sentiment_neuron  # noqa: PLC0415  (deferred: --help must not load torch)
    return probe_sentiment_neuron(args)



def cli() -> int:
    """The console script (pyproject.toml)."""
    return 0 if main() else 1


if __name__ == "__main__":
    sys.exit(cli())
