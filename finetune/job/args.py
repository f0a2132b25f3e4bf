"""The finetuning job's arguments (model, data, optimization, output) and their checks, each bad value
named before any work (no torch: ``mds-finetune --help`` loads none).

    mds-finetune --base runs/gpt2 --train E-c-train.tsv --dev E-c-dev.tsv --save runs/ec [--labels plutchik]
"""
from __future__ import annotations

import argparse

from finetune.lm.job.arguments import add_lora_args
from pipeline.job.arguments import add_engine_args, add_run_args
from pipeline.job.errors import ArgumentParser, UserError
from pipeline.job.numbers import non_negative_float, non_negative_int, positive_float, positive_int, probability


class FinetuneError(UserError, ValueError):
    """Arguments or inputs the job cannot work with (the message says which and why)."""


def parse_args(argv=None, description: str = __doc__):
    p = ArgumentParser(prog="mds-finetune", description=description)
    _add_model_args(p.add_argument_group("model"))
    _add_data_args(p, p.add_argument_group("data"))
    _add_optimization_args(p.add_argument_group("optimization"))
    add_lora_args(p, switch=True)
    g = p.add_argument_group("output")
    g.add_argument("--save", default=None, help="output directory (the classifier, eval.json, predictions, ...); "
                                                "the same command again continues an interrupted run in it "
                                                "(docs/runs.md)")
    g.add_argument("--force", action="store_true", help="write into an existing --save that holds an earlier "
                                                        "classifier of this job, or start an interrupted run afresh")
    g.add_argument("--save-interval", type=positive_int, default=None, metavar="N",
                   help="also save the training state every N steps into SAVE/checkpoint (a stop signal saves it "
                        "anyway); the same command continues an interrupted run from it")
    g.add_argument("--hf-export", choices=["auto", "no"], default="auto",
                   help="auto: write the Hugging Face classifier to SAVE/hf when the head allows it")
    g.add_argument("--eval-interval", type=positive_int, default=None, help="steps between dev evaluations "
                                                                   "(default: each epoch)")
    g.add_argument("--no-resume", action="store_true",
                   help="start a new run: refused when --save already holds files (choose a new directory). Without "
                        "it, the same command again continues the run in --save (docs/runs.md)")
    add_run_args(p, g, log_interval=10)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def _add_model_args(g) -> None:
    g.add_argument("--base", required=True, help="base model directory (pretraining checkpoint, config.json + "
                                                  "model.safetensors, or a classifier)")
    g.add_argument("--tokenizer", default=None, help="override the base model's tokenizer (a directory or "
                                                      "tokenizer.json; it must fit the model's vocabulary)")
    g.add_argument("--pooling", choices=["last", "mean", "max", "attention", "labels", "none"], default=None,
                   help="default: last (GPT); labels: every text followed by the label names, each label's logit "
                        "read at its own name (SpanEmo's idea for a decoder); the mLSTM summarises each text "
                        "itself (its final cell state): none")
    g.add_argument("--mlp-hidden", default="", help="comma-separated hidden widths of an MLP head (default: linear)")
    g.add_argument("--dropout", type=probability(open_high=True), default=0.1, help="head dropout")
    g.add_argument("--encoder-dropout", type=probability(open_high=True), default=None,
                   help="hidden and attention dropout of the encoder (default: the base model's config)")
    g.add_argument("--head-bias", choices=["auto", "yes", "no"], default="auto",
                   help="output bias of the head; auto: yes for gpt2, no for llama (Hugging Face's "
                        "LlamaForSequenceClassification has none, so the classifier stays exportable)")
    g.add_argument("--aux-lm-weight", type=non_negative_float, default=0.0,
                   help="weight of the auxiliary language-model loss")
    g.add_argument("--label-correlation", type=non_negative_float, default=0.0, metavar="ALPHA",
                   help="multilabel: (1 - ALPHA) BCE + ALPHA x SpanEmo's label-correlation loss (each present label "
                        "pushed above each absent one; SpanEmo uses 0.2); 0: BCE alone")
    g.add_argument("--freeze-encoder", action="store_true",
                   help="train the head only (a linear probe with a linear head); the pooled features are computed "
                        "once, before training, unless the pooling is 'attention'")
    g.add_argument("--freeze-embeddings", action="store_true",
                   help="keep the encoder's input embeddings fixed (fewer parameters to update)")
    g.add_argument("--encoder-layers", type=positive_int, default=None,
                   help="keep only the base model's first N transformer layers (a cheaper encoder)")
    g.add_argument("--max-length", type=positive_int, default=128, help="tokens per text (longer texts are cut)")


def _add_data_args(p, g) -> None:
    g.add_argument("--train", required=True, help="labelled training file (E-c TSV, SST-2 TSV, CSV/TSV/JSON(L))")
    g.add_argument("--dev", required=True, help="labelled development file (thresholds, evaluation)")
    g.add_argument("--test", default=None, help="file to predict (labelled: scored too; E-c with NONE labels: "
                                                "predictions only)")
    g.add_argument("--labels", default=None,
                   help="label subset: 'ec' (the 11 E-c emotions), 'plutchik' (8), or comma-separated names")
    g.add_argument("--text-column", default="text", help="text column of a CSV/TSV/JSON(L) file")
    g.add_argument("--id-column", default=None, help="ID column of a CSV/TSV/JSON(L) file (default: row numbers)")
    g.add_argument("--label-columns", default=None, help="comma-separated 0/1 label columns (multilabel)")
    g.add_argument("--label-list-column", default=None, help="column with each row's list of labels (multilabel)")
    g.add_argument("--label-column", default=None, help="column with one class per row (single-label)")
    g.add_argument("--label-names", default=None, help="comma-separated label names and order")
    g.add_argument("--label-separator", default=",", help="separator of --label-list-column's labels")
    g.add_argument("--no-normalize", action="store_true", help="keep texts as written (no tweet normalisation)")
    g.add_argument("--lowercase", action="store_true", help="lowercase the texts")
    g.add_argument("--holdout", type=probability(open_high=True), default=0.0,
                   help="fraction of train held out to tune thresholds on (0: tune on dev, which makes the dev "
                        "scores at tuned thresholds optimistic)")
    g.add_argument("--holdout-seed", type=non_negative_int, default=1234,
                   help="seed of the held-out split, apart from --seed, so that classifiers trained with other seeds "
                        "hold out the same tweets (what averaging them needs)")
    g.add_argument("--threshold-objective", choices=["macro", "micro", "balanced", "mean"], default="micro",
                   help="macro: each class's threshold maximises that class's F1 (what maximises macro-F1); micro: "
                        "then coordinate ascent for micro-F1; balanced: for the mean of micro- and macro-F1; "
                        "mean: for the mean of micro-F1, macro-F1 and Jaccard accuracy")
    g.add_argument("--threshold-bagging", type=non_negative_int, default=0, metavar="N",
                   help="average the thresholds tuned "
                   "on N bootstrap resamples of the tuning set (less variance from a small tuning set; 0: tune once)")
    add_engine_args(p, pipeline_parallel=False)  # without --micro-batch-size: chosen from the data (providers)
    g.add_argument("--eval-batch-size", type=positive_int, default=64, help="texts per forward when scoring")
    g.add_argument("--group-by-length", type=non_negative_int, default=0, metavar="N",
                   help="batch training texts of similar length together (pools of N global batches sorted by "
                        "length, the batches shuffled), so little of a batch is padding; 0: random batches")


def _add_optimization_args(g) -> None:
    g.add_argument("--epochs", type=positive_float, default=3.0, help="passes over the training texts")
    g.add_argument("--train-steps", type=positive_int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--lr", type=positive_float, default=5e-5, help="peak learning rate")
    g.add_argument("--min-lr", type=non_negative_float, default=0.0, help="the learning rate the decay ends at")
    g.add_argument("--warmup", type=probability(), default=0.1,
                   help="warmup steps, as a fraction of the training steps")
    g.add_argument("--lr-decay-style", choices=["linear", "cosine", "constant"], default="linear",
                   help="the decay after warmup")
    g.add_argument("--weight-decay", type=non_negative_float, default=None, help="default: the DeepSpeed config's")
    g.add_argument("--layer-lr-decay", type=positive_float, default=1.0,
                   help="learning-rate factor per encoder layer from the top (e.g. 0.9); 1 = none")
    g.add_argument("--head-lr-mult", type=positive_float, default=1.0, help="learning-rate multiple of the head")
    g.add_argument("--pos-weight", default="none",
                   help="BCE positive weights: none, balanced (negatives/positives), sqrt (its square root), or "
                        "comma-separated numbers, one per label")
    g.add_argument("--pos-weight-max", type=positive_float, default=10.0, help="cap of balanced/sqrt positive weights")


def check_args(p: argparse.ArgumentParser, args) -> None:
    problems = []
    if args.epochs <= 0 and args.train_steps is None:
        problems.append(f"--epochs must be > 0, got {args.epochs}")
    at_least = {"--train-steps": (args.train_steps, 1), "--group-by-length": (args.group_by_length, 0),
                "--threshold-bagging": (args.threshold_bagging, 0), "--encoder-layers": (args.encoder_layers, 1),
                "--max-length": (args.max_length, 1), "--save-interval": (args.save_interval, 1)}
    problems += [f"{flag} must be >= {low}, got {value}" for flag, (value, low) in at_least.items()
                 if value is not None and value < low]
    if not 0.0 <= args.holdout < 1.0:
        problems.append(f"--holdout must be in [0, 1), got {args.holdout}")
    if not 0.0 <= args.warmup < 1.0:
        problems.append(f"--warmup is a fraction of the training steps in [0, 1), got {args.warmup}")
    if args.freeze_encoder and (args.lora or args.lora_r or args.lora_target_modules):
        problems.append("--lora trains adapters on the encoder: it cannot be combined with --freeze-encoder")
    if args.freeze_encoder and args.aux_lm_weight:
        problems.append("--aux-lm-weight trains the encoder: it cannot be combined with --freeze-encoder")
    if not 0.0 <= args.label_correlation < 1.0:
        problems.append(f"--label-correlation must be in [0, 1), got {args.label_correlation}")
    if args.lr <= 0:
        problems.append(f"--lr must be > 0, got {args.lr}")
    try:
        args.mlp_hidden = tuple(int(w) for w in args.mlp_hidden.split(",") if w.strip())
    except ValueError:
        problems.append(f"--mlp-hidden takes comma-separated integers, got {args.mlp_hidden!r}")
    if problems:
        p.error("; ".join(problems))
