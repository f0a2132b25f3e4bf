"""The finetuning job: a text classifier (multilabel emotions, or single-label) on a pretrained project model.

    deepspeed --num_gpus N finetune/train.py --base runs/gpt2 --train E-c-train.tsv --dev E-c-dev.tsv \
        --deepspeed_config ds_configs/bf16_zero1.json --tensor-parallel 2 --global-batch-size 32 \
        --epochs 3 --lr 3e-5 --save runs/ec [--test E-c-test.tsv] [--labels plutchik]

Also runs under ``torchrun`` and as ``python -m finetune.train`` (one process). ``--base`` is a pretraining
run of this project (a GPT saved at any TP/PP layout, or an mLSTM), a ``config.json`` + ``model.safetensors``
directory (e.g. an imported Hugging Face model) or a finetuned classifier. Texts are tokenised with the base
model's tokenizer. The GPT runs at any tensor-parallel size (pipeline parallelism is not used for finetuning);
the mLSTM is data-parallel only and classifies from its final cell state.

Writes into ``--save``: the classifier (classifier.json, model.safetensors as a full TP=1 state dict,
thresholds.json tuned on dev or on a held-out part of train, tokenizer/), metrics.jsonl, eval.json (scores at
0.5 and at the tuned thresholds), per_class_f1.png, predictions in the official E-c format
(dev_predictions.txt, test_predictions.txt) and, when the head is one Hugging Face can hold, the exported
``transformers`` classifier in hf/.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

import finetune.data as data
from finetune.batching import TrainBatches, encode_texts, pooled_features, predict_encoded, predict_pooled
from finetune.data import SEMEVAL_EC_LABELS, load_data, load_labeled_file, load_semeval_ec
from finetune.export_hf import ExportError, export_classifier
from finetune.heads import MULTILABEL, HeadConfig, pos_weight_from_labels
from finetune.metrics import (
    PUBLISHED_EC_TEST_F1,
    evaluate_probabilities,
    format_comparison,
    plot_per_class_f1,
    single_label_scores,
    write_eval_json,
)
from finetune.model import build_classifier, encoder_type_of
from finetune.normalize import TweetNormalizer
from finetune.predictions import write_predictions
from finetune.saved import CLASSIFIER_FILE, load_base_state, save_classifier_dir
from finetune.thresholds import apply_thresholds, bagged_thresholds, tune_thresholds
from models.parallel import gather_full, get_shard_spec
from pipeline.data import load_tokenizer
from pipeline.engine.build import build_engine
from pipeline.engine.steps import optimizer_step
from pipeline.engine.ds_config import precision
from pipeline.job.errors import ArgumentParser, UserError, command
from pipeline.job.families import ModelFamily, family_of
from pipeline.job.files import OutputError, refuse_overlap
from pipeline.job.options import EngineOptions, add_engine_args, add_run_args
from pipeline.job.loop import (Job, StepResult, apply_sequence_parallel, every, is_rank0, quiet_deepspeed, setup,
                               train_loop)
from pipeline.tracking.metrics import MetricsWriter
from pipeline.engine.schedules import LRSchedule

LABEL_SETS = {"ec": "SEMEVAL_EC_LABELS", "plutchik": "PLUTCHIK_LABELS"}


class FinetuneError(UserError, ValueError):
    """Arguments or inputs the job cannot work with (the message says which and why)."""


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    g = p.add_argument_group("model")
    g.add_argument("--base", required=True, help="base model directory (pretraining checkpoint, config.json + "
                                                  "model.safetensors, or a classifier)")
    g.add_argument("--tokenizer", default=None, help="override the base model's tokenizer (a directory or "
                                                      "tokenizer.json; it must fit the model's vocabulary)")
    g.add_argument("--pooling", choices=["last", "mean", "max", "attention", "none"], default=None,
                   help="default: last (GPT); the mLSTM summarises each text itself (its final cell state): none")
    g.add_argument("--mlp-hidden", default="", help="comma-separated hidden widths of an MLP head (default: linear)")
    g.add_argument("--dropout", type=float, default=0.1, help="head dropout")
    g.add_argument("--encoder-dropout", type=float, default=None,
                   help="hidden and attention dropout of the encoder (default: the base model's config)")
    g.add_argument("--head-bias", choices=["auto", "yes", "no"], default="auto",
                   help="output bias of the head; auto: yes for gpt2, no for llama (Hugging Face's "
                        "LlamaForSequenceClassification has none, so the classifier stays exportable)")
    g.add_argument("--aux-lm-weight", type=float, default=0.0, help="weight of the auxiliary language-model loss")
    g.add_argument("--freeze-encoder", action="store_true",
                   help="train the head only (a linear probe with a linear head); the pooled features are computed "
                        "once, before training, unless the pooling is 'attention'")
    g.add_argument("--freeze-embeddings", action="store_true",
                   help="keep the encoder's input embeddings fixed (fewer parameters to update)")
    g.add_argument("--encoder-layers", type=int, default=None,
                   help="keep only the base model's first N transformer layers (a cheaper encoder)")
    g.add_argument("--max-length", type=int, default=128, help="tokens per text (longer texts are cut)")
    g = p.add_argument_group("data")
    g.add_argument("--train", required=True, help="labelled training file (E-c TSV, SST-2 TSV, CSV/TSV/JSON(L))")
    g.add_argument("--dev", required=True, help="labelled development file (thresholds, evaluation)")
    g.add_argument("--test", default=None, help="file to predict (labelled: scored too; E-c with NONE labels: "
                                                "predictions only)")
    g.add_argument("--labels", default=None,
                   help="label subset: 'ec' (the 11 E-c emotions), 'plutchik' (8), or comma-separated names")
    g.add_argument("--text-column", default="text")
    g.add_argument("--id-column", default=None)
    g.add_argument("--label-columns", default=None, help="comma-separated 0/1 label columns (multilabel)")
    g.add_argument("--label-list-column", default=None, help="column with each row's list of labels (multilabel)")
    g.add_argument("--label-column", default=None, help="column with one class per row (single-label)")
    g.add_argument("--label-names", default=None, help="comma-separated label names and order")
    g.add_argument("--label-separator", default=",")
    g.add_argument("--no-normalize", action="store_true", help="keep texts as written (no tweet normalisation)")
    g.add_argument("--lowercase", action="store_true")
    g.add_argument("--holdout", type=float, default=0.0,
                   help="fraction of train held out to tune thresholds on (0: tune on dev, which makes the dev "
                        "scores at tuned thresholds optimistic)")
    g.add_argument("--threshold-objective", choices=["macro", "micro", "balanced", "mean"], default="micro",
                   help="macro: each class's threshold maximises that class's F1 (what maximises macro-F1); micro: "
                        "then coordinate ascent for micro-F1; balanced: for the mean of micro- and macro-F1; "
                        "mean: for the mean of micro-F1, macro-F1 and Jaccard accuracy")
    g.add_argument("--threshold-bagging", type=int, default=0, metavar="N", help="average the thresholds tuned "
                   "on N bootstrap resamples of the tuning set (less variance from a small tuning set; 0: tune once)")
    add_engine_args(p, pipeline_parallel=False)
    g.add_argument("--eval-batch-size", type=int, default=64)
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=float, default=3.0)
    g.add_argument("--train-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--warmup", type=float, default=0.1, help="warmup steps, as a fraction of the training steps")
    g.add_argument("--lr-decay-style", choices=["linear", "cosine", "constant"], default="linear")
    g.add_argument("--weight-decay", type=float, default=None, help="default: the DeepSpeed config's")
    g.add_argument("--layer-lr-decay", type=float, default=1.0,
                   help="learning-rate factor per encoder layer from the top (e.g. 0.9); 1 = none")
    g.add_argument("--head-lr-mult", type=float, default=1.0, help="learning-rate multiple of the head")
    g.add_argument("--pos-weight", default="none",
                   help="BCE positive weights: none, balanced (negatives/positives), sqrt (its square root), or "
                        "comma-separated numbers, one per label")
    g.add_argument("--pos-weight-max", type=float, default=10.0, help="cap of balanced/sqrt positive weights")
    g = p.add_argument_group("output")
    g.add_argument("--save", default=None, help="output directory (the classifier, eval.json, predictions, ...); "
                                                "new or empty unless --force")
    g.add_argument("--force", action="store_true", help="write into an existing --save that holds an earlier "
                                                        "classifier of this job")
    g.add_argument("--hf-export", choices=["auto", "no"], default="auto",
                   help="auto: write the Hugging Face classifier to SAVE/hf when the head allows it")
    g.add_argument("--eval-interval", type=int, default=None, help="steps between dev evaluations "
                                                                   "(default: each epoch)")
    add_run_args(p, g, log_interval=10)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args) -> None:
    problems = []
    if args.epochs <= 0 and args.train_steps is None:
        problems.append(f"--epochs must be > 0, got {args.epochs}")
    if args.train_steps is not None and args.train_steps < 1:
        problems.append(f"--train-steps must be >= 1, got {args.train_steps}")
    if not 0.0 <= args.holdout < 1.0:
        problems.append(f"--holdout must be in [0, 1), got {args.holdout}")
    if args.threshold_bagging < 0:
        problems.append(f"--threshold-bagging must be >= 0, got {args.threshold_bagging}")
    if not 0.0 <= args.warmup < 1.0:
        problems.append(f"--warmup is a fraction of the training steps in [0, 1), got {args.warmup}")
    if args.encoder_layers is not None and args.encoder_layers < 1:
        problems.append(f"--encoder-layers must be >= 1, got {args.encoder_layers}")
    if args.freeze_encoder and args.aux_lm_weight:
        problems.append("--aux-lm-weight trains the encoder: it cannot be combined with --freeze-encoder")
    if args.max_length < 1:
        problems.append(f"--max-length must be >= 1, got {args.max_length}")
    if args.lr <= 0:
        problems.append(f"--lr must be > 0, got {args.lr}")
    try:
        args.mlp_hidden = tuple(int(w) for w in args.mlp_hidden.split(",") if w.strip())
    except ValueError:
        problems.append(f"--mlp-hidden takes comma-separated integers, got {args.mlp_hidden!r}")
    if problems:
        p.error("; ".join(problems))


# ------------------------------------------------------------------------------------------------ data

def load_split(path: str, args, require_labels: bool = True):
    """A data file as ``LabeledTexts`` with the job's label options."""
    kwargs = {}
    for name in ("label_list_column", "label_column"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    if args.label_columns:
        kwargs["label_columns"] = _names(args.label_columns)
    if args.label_names:
        kwargs["label_names"] = _names(args.label_names)
    if kwargs or args.text_column != "text" or args.id_column:
        kwargs.update(text_column=args.text_column, id_column=args.id_column, label_separator=args.label_separator)
        data = load_labeled_file(path, **kwargs)
    elif not require_labels and Path(path).is_file() and _is_ec(path):
        data = load_semeval_ec(path, labels=None, require_labels=False)
    else:
        data = load_data(path)
    if require_labels and data.labels is None:
        raise FinetuneError(f"{path} has no labels (name the label columns: --label-columns, --label-list-column or "
                            f"--label-column)")
    return data


def _is_ec(path) -> bool:
    with open(path, encoding="utf-8-sig") as f:
        return f.readline().split("\t")[:2] == ["ID", "Tweet"]


def _names(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def label_subset(spec: str | None):
    if spec is None:
        return None
    if spec in LABEL_SETS:
        return list(getattr(data, LABEL_SETS[spec]))
    return _names(spec)


def parse_pos_weight(spec: str, labels: np.ndarray, cap: float):
    if spec == "none":
        return None
    if spec in ("balanced", "sqrt"):
        w = pos_weight_from_labels(labels, max_weight=None)
        w = w.sqrt() if spec == "sqrt" else w
        return w.clamp(max=cap)
    try:
        w = torch.tensor([float(x) for x in spec.split(",")], dtype=torch.float32)
    except ValueError:
        raise FinetuneError(f"--pos-weight: expected none, balanced, sqrt or comma-separated numbers, "
                            f"got {spec!r}") from None
    if w.numel() != labels.shape[1] or bool((w <= 0).any()):
        raise FinetuneError(f"--pos-weight: {w.numel()} weights for {labels.shape[1]} labels "
                            f"(need one > 0 per label)")
    return w


def check_encoder_options(args, family) -> None:
    """An encoder that summarises each text itself (the mLSTM: pooling 'none') takes no other pooling and has
    no layers to cut; a family without tensor parallelism runs data-parallel only."""
    encoder = family.get("encoder")
    if encoder.default_pooling == "none":
        problems = []
        if args.tensor_parallel != 1 and not family.tensor_parallel_capable:
            problems.append(f"--tensor-parallel {args.tensor_parallel} (the {family.name} is data-parallel only)")
        if args.pooling not in (None, "none"):
            problems.append(f"--pooling {args.pooling} (its features are the final cell state: pooling 'none')")
        if args.encoder_layers is not None:
            problems.append("--encoder-layers")
        if problems:
            raise FinetuneError(f"{args.base} is an {family.name}, which does not take " + "; ".join(problems))
    elif args.pooling == "none":
        raise FinetuneError("--pooling none is for encoders that summarise a text themselves (the mLSTM); a GPT "
                            "gives hidden states per token: choose last, mean, max or attention")


def first_layers(config, state: dict, n: int, source: str):
    """The base model cut to its first ``n`` transformer layers (config and full state dict)."""
    if n > config.num_layers:
        raise FinetuneError(f"--encoder-layers {n}: {source} has only {config.num_layers} layers")
    kept = {k: v for k, v in state.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n}
    return dataclasses.replace(config, num_layers=n), kept


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64([seed, 4242]))
    order = rng.permutation(n)
    k = int(round(n * fraction))
    return np.sort(order[k:]), np.sort(order[:k])


# ------------------------------------------------------------------------------------------- training

def classifier_forward(engine, batch) -> dict:
    """The losses of one micro-batch (token ids, or the pooled features of a frozen encoder)."""
    dev = engine.device
    if "pooled" in batch:
        parts = engine(None, batch["labels"].to(dev), pooled=batch["pooled"].to(dev), return_parts=True)
    else:
        parts = engine(batch["input_ids"].to(dev), batch["labels"].to(dev), lengths=batch["lengths"].to(dev),
                       return_parts=True)
    return {**parts, "tokens": batch["lengths"].sum() if "lengths" in batch else 0}


def finetune_step(engine, batches) -> dict:
    """One optimizer step over all micro-batches of the global batch; mean losses over them and over DP
    (tokens: summed)."""
    out = optimizer_step(engine, batches, classifier_forward, counts=("tokens",))
    out["tokens"] = int(out["tokens"])
    return out


def full_fp32_state(engine) -> dict[str, torch.Tensor]:
    """The classifier's full TP=1 state dict from the fp32 master weights (collective over all ranks)."""

    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p) if p.requires_grad else None
        value = (master if master is not None else p.detach()).float()
        out[name] = gather_full(value, get_shard_spec(p)).cpu()
    return out


@command
def main(argv=None) -> dict:
    """Run the job; a bad argument or input is one line ``error: <what and where>`` and exit code 2."""
    return run(parse_args(argv))


def check_save(args) -> None:
    """--save never is, or holds, an input (the base run would be written into); an existing non-empty one
    is used only with --force, and only when it holds a classifier this job wrote."""
    if args.save is None:
        return
    refuse_overlap(args.save, [("--base", args.base), ("--train", args.train), ("--dev", args.dev),
                               ("--test", args.test), ("--tokenizer", args.tokenizer)], "--save")
    save = Path(args.save)
    if save.is_dir() and any(save.iterdir()):
        if not args.force:
            raise OutputError(f"--save {save} is not empty; choose a new directory or pass --force to replace "
                              f"the classifier in it")
        if not (save / CLASSIFIER_FILE).is_file():
            raise OutputError(f"--save {save} holds no {CLASSIFIER_FILE}: it is not a classifier directory of this "
                              f"job, and --force replaces only those; choose a new or empty directory")
        (save / "metrics.jsonl").unlink(missing_ok=True)  # this job's own log of the run it replaces
    elif save.exists() and not save.is_dir():
        raise OutputError(f"--save {save} is a file; give a directory")


# ------------------------------------------------------------------------------------------ providers

@dataclass
class Base:
    """The base model provider's result: the encoder's family, config and full weights, and its tokenizer."""
    family: ModelFamily
    config: object
    state: dict
    tokenizer: object
    max_length: int
    pad_id: int


def provide_base(args) -> Base:
    """Inputs are read and checked before any process group exists: a bad file fails at once, on every rank."""
    config, base_state, tokenizer_dir = load_base_state(args.base)
    family = family_of(config)
    check_encoder_options(args, family)
    if args.tokenizer is None and tokenizer_dir is None:
        raise FinetuneError(f"{args.base} holds no tokenizer; pass --tokenizer")
    try:
        tokenizer = load_tokenizer(args.tokenizer or str(tokenizer_dir))
    except ValueError as e:
        raise FinetuneError(f"tokenizer: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise FinetuneError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model in {args.base} only "
                            f"{config.vocab_size}: it is not this model's tokenizer")
    if args.encoder_dropout is not None:
        for name in ("hidden_dropout", "attention_dropout", "dropout"):  # the GPT's two, the mLSTM's one
            if hasattr(config, name):
                setattr(config, name, args.encoder_dropout)
    if args.encoder_layers is not None:
        config, base_state = first_layers(config, base_state, args.encoder_layers, args.base)
    family.check_layout(config, args.tensor_parallel, 1)
    max_length = min(args.max_length, getattr(config, "max_sequence_length", args.max_length))
    pad_id = tokenizer.backend.token_to_id(tokenizer.pad_token) if tokenizer.pad_token else None
    pad_id = tokenizer.eod_id if pad_id is None or pad_id >= config.vocab_size else pad_id
    return Base(family, config, base_state, tokenizer, max_length, pad_id)


@dataclass
class Splits:
    """The data provider's result: the splits, and their texts as token ids."""
    train: object
    dev: object
    tune_on: object  # where the thresholds are tuned: dev, or a held-out part of train
    test: object | None
    encoded: dict
    truncated: int
    normalizer: TweetNormalizer | None

    @property
    def multilabel(self) -> bool:
        return self.train.task == MULTILABEL


def provide_data(args, base: Base) -> Splits:
    subset = label_subset(args.labels)
    train, dev = load_split(args.train, args), load_split(args.dev, args)
    test = load_split(args.test, args, require_labels=False) if args.test else None
    if subset is not None:
        try:
            train, dev = train.select_labels(subset), dev.select_labels(subset)
            test = test.select_labels(subset) if test is not None and test.labels is not None else test
        except ValueError as e:
            raise FinetuneError(f"--labels: {e}") from None
    for name, split in (("dev", dev), ("test", test)):
        if split is not None and split.labels is not None and split.label_names != train.label_names:
            raise FinetuneError(f"{name} labels {list(split.label_names)} differ from train labels "
                                f"{list(train.label_names)} (choose a common subset with --labels)")
    normalizer = None if args.no_normalize else TweetNormalizer(lowercase=args.lowercase)
    norm = (lambda texts: [normalizer(t) for t in texts]) if normalizer else list
    tune_on = dev
    if args.holdout:
        keep, held = holdout_split(len(train), args.holdout, args.seed)
        train, tune_on = train.subset(keep), train.subset(held)
    encoded = {name: encode_texts(base.tokenizer, norm(split.texts), base.max_length)
               for name, split in (("train", train), ("dev", dev), ("tune", tune_on), ("test", test))
               if split is not None}
    truncated = sum(len(ids) == base.max_length for ids in encoded["train"])
    return Splits(train, dev, tune_on, test, encoded, truncated, normalizer)


@dataclass
class Head:
    config: HeadConfig
    pos_weight: torch.Tensor | None
    priors: np.ndarray


def provide_head(args, base: Base, data: Splits) -> Head:
    config = base.config
    head_bias = {"yes": True, "no": False, "auto": getattr(config, "variant", None) != "llama"}[args.head_bias]
    pooling = args.pooling or base.family.get("encoder").default_pooling
    try:
        head_config = HeadConfig(config.hidden_size, data.train.num_labels, pooling=pooling,
                                 mlp_hidden=args.mlp_hidden, dropout=args.dropout, problem_type=data.train.task,
                                 label_names=data.train.label_names, output_bias=head_bias)
    except ValueError as e:
        raise FinetuneError(str(e)) from None
    if args.pos_weight != "none" and not data.multilabel:
        raise FinetuneError("--pos-weight is for multilabel data")
    pos_weight = parse_pos_weight(args.pos_weight, data.train.labels, args.pos_weight_max) if data.multilabel else None
    return Head(head_config, pos_weight, data.train.labels.mean(axis=0))


def provide_engine(args, base: Base, data: Splits, head: Head, job: Job):
    """(engine, LR schedule, steps per epoch, total steps)."""
    def builder(cfg, init_seed):
        return build_classifier(cfg, head.config, encoder_state=base.state, init_seed=init_seed,
                                aux_lm_weight=args.aux_lm_weight, pos_weight=head.pos_weight,
                                freeze_encoder=args.freeze_encoder, freeze_embeddings=args.freeze_embeddings,
                                label_priors=head.priors, source=str(args.base))

    def groups(model):
        return model.param_groups(weight_decay=args.weight_decay, layer_lr_decay=args.layer_lr_decay,
                                  head_lr_mult=args.head_lr_mult)

    steps_per_epoch = len(data.train) // job.global_batch
    if steps_per_epoch < 1:
        raise FinetuneError(f"{len(data.train)} training examples are fewer than one global batch "
                            f"({job.global_batch}); use a smaller --global-batch-size")
    total_steps = args.train_steps or max(1, math.ceil(args.epochs * steps_per_epoch))
    schedule = LRSchedule(args.lr, int(args.warmup * total_steps), total_steps, args.lr_decay_style, args.min_lr)
    engine = build_engine(base.config, job.ds, job.state, init_seed=args.seed, schedule=schedule,
                          model_builder=builder, param_groups_fn=groups)
    base.state = None  # the engine holds the weights now
    return engine, schedule, steps_per_epoch, total_steps


def run_settings(args, base: Base, data: Splits, head: Head, job: Job, steps: tuple[int, int], cached: bool) -> dict:
    steps_per_epoch, total_steps = steps
    return {"base": str(args.base), "train": data.train.source, "dev": data.dev.source,
            "labels": list(data.train.label_names),
            "examples": {"train": len(data.train), "dev": len(data.dev), "threshold_tuning": len(data.tune_on)},
            "thresholds_tuned_on": "holdout" if args.holdout else "dev",
            "threshold_objective": args.threshold_objective, "threshold_bagging": args.threshold_bagging,
            "max_length": base.max_length,
            "truncated_train_texts": data.truncated, "global_batch": job.global_batch, "micro_batch": job.micro_batch,
            "steps": total_steps, "steps_per_epoch": steps_per_epoch, "lr": args.lr,
            "layer_lr_decay": args.layer_lr_decay, "head_lr_mult": args.head_lr_mult,
            "pos_weight": None if head.pos_weight is None else head.pos_weight.tolist(),
            "aux_lm_weight": args.aux_lm_weight,
            "freeze_encoder": args.freeze_encoder, "freeze_embeddings": args.freeze_embeddings,
            "features_computed_once": cached,
            "encoder": base.family.name, "encoder_layers": base.config.num_layers, "pooling": head.config.pooling,
            "mlp_hidden": list(args.mlp_hidden),
            "precision": precision(job.ds), "tensor_parallel": job.state.tensor_parallel,
                "sequence_parallel": bool(getattr(base.config, "sequence_parallel", False)),
            "data_parallel": job.state.data_parallel, "seed": args.seed}


@dataclass
class FinetuneRun:
    """What the end of the job (thresholds, scores, predictions, the saved classifier) works from."""
    args: argparse.Namespace
    base: Base
    data: Splits
    head: Head
    engine: object
    predict: Callable
    save: Path | None
    metrics: MetricsWriter
    settings: dict


# ------------------------------------------------------------------------------------------------ the job

def run(args) -> dict:
    check_save(args)
    if not args.verbose:
        quiet_deepspeed(False)
    base = provide_base(args)
    data = provide_data(args, base)
    head = provide_head(args, base, data)
    job = setup(EngineOptions.from_args(args))
    apply_sequence_parallel(base.config, job)
    engine, schedule, steps_per_epoch, total_steps = provide_engine(args, base, data, head, job)
    state = job.state
    dp_kwargs = dict(dp_rank=state.get_data_parallel_rank(), dp_world_size=state.data_parallel,
                     dp_group=state.get_data_parallel_group())
    cached = args.freeze_encoder and head.config.pooling != "attention"
    encoded = data.encoded
    t_features = time.perf_counter()
    if cached:  # a frozen encoder gives the same features every epoch: compute them once
        encoded = {name: pooled_features(engine.module, ids, base.pad_id, batch_size=args.eval_batch_size,
                                         progress=is_rank0(), desc=f"features {name}", **dp_kwargs)
                   for name, ids in encoded.items()}
    feature_seconds = time.perf_counter() - t_features if cached else 0.0
    batches = TrainBatches(encoded["train"], data.train.labels, job.micro_batch, state.get_data_parallel_rank(),
                           state.data_parallel, base.pad_id, seed=args.seed)

    save = Path(args.save) if args.save else None
    metrics = MetricsWriter(save / "metrics.jsonl" if save and is_rank0() else None, monitor=engine.monitor,
                            prefix="finetune")
    settings = run_settings(args, base, data, head, job, (steps_per_epoch, total_steps), cached)
    metrics.write({"settings": settings})

    def predict(name, progress=False):
        if cached:
            return predict_pooled(engine.module, encoded[name])
        return predict_encoded(engine.module, encoded[name], base.pad_id, batch_size=args.eval_batch_size,
                               progress=progress and is_rank0(), desc=f"predict {name}", **dp_kwargs)

    losses, t0 = [], time.perf_counter()
    hooks = loop_hooks(args, engine, data, predict, metrics, schedule, steps_per_epoch, job.global_batch, losses)
    train_loop(lambda: finetune_step(engine, batches), first=1, last=total_steps, desc="finetune", hooks=hooks)
    train_seconds = time.perf_counter() - t0

    # thresholds, scores, predictions
    result = finish(FinetuneRun(args, base, data, head, engine, predict, save, metrics, settings))
    result.update(losses=losses, train_seconds=train_seconds, feature_seconds=feature_seconds, steps=total_steps,
                  sequence_parallel=settings["sequence_parallel"],
                  group_lrs=[(g.get("lr_mult", 1.0), g["lr"]) for g in engine.optimizer.param_groups])
    metrics.close()
    return result


def loop_hooks(args, engine, data: Splits, predict, metrics, schedule, steps_per_epoch: int, global_batch: int,
               losses: list) -> list:
    """The training loop's hooks: keep each loss, log every --log-interval steps, score dev every
    --eval-interval steps (default each epoch; the end of the job scores it anyway)."""
    window = {"tokens": 0, "seconds": 0.0}

    def keep(r: StepResult) -> None:
        losses.append(r.out["loss"])
        window["tokens"] += r.out["tokens"]
        window["seconds"] += r.seconds

    def log(r: StepResult) -> None:
        norm_ = engine.get_global_grad_norm()
        full_window = r.step % args.log_interval == 0
        record = {"step": r.step, "epoch": r.step / steps_per_epoch,
                  **{k: v for k, v in r.out.items() if k != "tokens"},
                  "lr": schedule(r.step - 1), "grad_norm": None if norm_ is None else float(norm_),
                  "tokens_per_s": window["tokens"] / window["seconds"],
                  "examples_per_s": global_batch * args.log_interval / window["seconds"] if full_window else None}
        metrics.write(record)
        r.bar.set_postfix(loss=f"{r.out['loss']:.4f}", lr=f"{record['lr']:.2e}")
        window.update(tokens=0, seconds=0.0)

    def evaluate(r: StepResult) -> None:
        scores = dev_scores(data, predict("dev"))
        metrics.write({"step": r.step, "epoch": r.step / steps_per_epoch, **scores})
        r.bar.write(f"step {r.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    return [keep, every(args.log_interval, log), every(args.eval_interval or steps_per_epoch, evaluate, at_last=False)]


def dev_scores(data: Splits, probs) -> dict:
    dev = data.dev
    if data.multilabel:
        s = evaluate_probabilities(dev.labels, probs, dev.label_names)["at_0.5"]
        return {"dev_micro_f1": s["micro_f1"], "dev_macro_f1": s["macro_f1"], "dev_jaccard": s["jaccard"]}
    s = single_label_scores(dev.class_indices(), probs.argmax(1), dev.label_names)
    return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"]}


def finish(r: FinetuneRun) -> dict:
    args, engine, predict, save, metrics, settings = r.args, r.engine, r.predict, r.save, r.metrics, r.settings
    train, dev, tune_on, test, multilabel = r.data.train, r.data.dev, r.data.tune_on, r.data.test, r.data.multilabel
    config, head_config, tokenizer, max_length = r.base.config, r.head.config, r.base.tokenizer, r.base.max_length
    normalizer = r.data.normalizer

    dev_probs = predict("dev", progress=True)
    tune_probs = dev_probs if tune_on is dev else predict("tune", progress=True)
    test_probs = predict("test", progress=True) if test is not None else None
    refine = None if args.threshold_objective == "macro" else args.threshold_objective
    thresholds = None
    if multilabel and args.threshold_bagging:
        thresholds = bagged_thresholds(tune_on.labels, tune_probs, refine=refine, resamples=args.threshold_bagging,
                                       seed=args.seed)
    elif multilabel:
        thresholds = tune_thresholds(tune_on.labels, tune_probs, refine=refine)
    results = {}

    def scores(data, probs):
        if multilabel:
            return evaluate_probabilities(data.labels, probs, data.label_names, thresholds)
        return {"single_label": single_label_scores(data.class_indices(), probs.argmax(1), data.label_names)}

    def decide(probs):
        if multilabel:
            return apply_thresholds(probs, thresholds)
        return np.eye(probs.shape[1], dtype=np.int8)[probs.argmax(1)]

    results["dev"] = scores(dev, dev_probs)
    if test is not None and test.labels is not None:
        results["test"] = scores(test, test_probs)
    metrics.write({"step": settings["steps"], **final_dev_record(results["dev"], multilabel)})
    state = full_fp32_state(engine)  # collective: every rank takes part
    out = {"dev": results["dev"], "thresholds": None if thresholds is None else thresholds.tolist(),
           "dev_probabilities": dev_probs, "test_probabilities": test_probs,
           "tune_probabilities": tune_probs, "tune_labels": tune_on.labels}
    if save is None or not is_rank0():
        _barrier()
        return out
    if multilabel:
        systems = {"threshold 0.5": results["dev"]["at_0.5"],
                   f"tuned on {settings['thresholds_tuned_on']}": results["dev"]["tuned"]}
        print(f"dev ({len(dev)} texts):\n" + format_comparison(systems))
        published = PUBLISHED_EC_TEST_F1 if set(train.label_names) <= set(SEMEVAL_EC_LABELS) else None
        plot_per_class_f1(save / "per_class_f1.png", results["dev"], reference=published,
                          reference_label="Kant et al. 2018, E-c test (the values the paper gives)",
                          title=f"Per-class F1 on dev ({Path(dev.source).name})")
    else:
        s = results["dev"]["single_label"]
        print(f"dev ({len(dev)} texts): accuracy {s['accuracy']:.4f}, macro-F1 {s['macro_f1']:.4f}")
    write_eval_json(save / "eval.json", results, settings=settings)
    write_predictions(save / "dev_predictions.txt", dev.ids, dev.texts, decide(dev_probs), train.label_names)
    if test is not None:
        write_predictions(save / "test_predictions.txt", test.ids, test.texts, decide(test_probs), train.label_names)
    training = {k: v for k, v in settings.items() if k not in ("examples",)}
    save_classifier_dir(save, full_state=state, encoder_type=encoder_type_of(config), encoder_config=config,
                        head_config=head_config, tokenizer=tokenizer, max_length=max_length, normalizer=normalizer,
                        thresholds=thresholds, training=training)
    metrics.write({"saved": str(save), **({"dev_tuned_micro_f1": results["dev"]["tuned"]["micro_f1"]}
                                          if multilabel else {})})
    if args.hf_export == "auto":
        out["hf_export"] = _export(save)
    _barrier()
    return out


def final_dev_record(dev: dict, multilabel: bool) -> dict:
    """The last step's dev scores (at 0.5 and with the tuned thresholds), for metrics.jsonl and the monitor."""
    if not multilabel:
        s = dev["single_label"]
        return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"]}
    return {f"dev{tag}_{k}": dev[key][k] for tag, key in (("", "at_0.5"), ("_tuned", "tuned"))
            for k in ("micro_f1", "macro_f1", "jaccard")}


def _export(save: Path):
    try:
        path = export_classifier(save, save / "hf", force=True)
    except ExportError as e:
        print(f"Hugging Face export skipped: {e}")
        return None
    print(f"Hugging Face classifier written to {path}")
    return str(path)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
