"""The finetuning job's inputs read and checked: data files with the job's label options, label subsets,
positive weights, encoder options, the held-out split, and the --save directory.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import finetune.data as data
from finetune.data import load_data, load_labeled_file, load_semeval_ec, require_rows
from finetune.heads import pos_weight_from_labels
from finetune.job.args import FinetuneError
from finetune.job.resume import CHECKPOINT_DIR
from finetune.saved import CLASSIFIER_FILE
from pipeline.job.faults import LOCK_FILE
from pipeline.job.files import OutputError, refuse_overlap
from pipeline.job.run_dir import ARGS_FILE, DS_CONFIG_FILE, changed_settings, refuse_non_empty

LABEL_SETS = {"ec": "SEMEVAL_EC_LABELS", "plutchik": "PLUTCHIK_LABELS"}


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
    return require_rows(data, path, "examples")


def _is_ec(path) -> bool:
    with open(path, "rb") as f:  # bytes: a file that is not UTF-8 is reported by its reader, at its line
        return f.readline().removeprefix(b"\xef\xbb\xbf").split(b"\t")[:2] == [b"ID", b"Tweet"]


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


def check_save(args) -> None:
    """--save never is, or holds, an input (the base run would be written into); an interrupted run in it is
    continued (``finetune.job.resume``); --no-resume takes a new or empty one only; a classifier this job wrote
    is replaced only with --force (the refusal names the settings that changed since, from its args.json)."""
    if args.save is None:
        return
    refuse_overlap(args.save, [("--base", args.base), ("--train", args.train), ("--dev", args.dev),
                               ("--test", args.test), ("--tokenizer", args.tokenizer)], "--save")
    save = Path(args.save)
    if save.exists() and not save.is_dir():
        raise OutputError(f"--save {save} is a file; give a directory")
    if args.no_resume:
        refuse_non_empty(save)
        return
    if (save / CHECKPOINT_DIR).is_dir() and _interrupted(save):
        if not args.force:  # a stopped run's saved state: the job continues it (finetune.job.resume)
            return
        print(f"note: --force: the interrupted run in --save {save} is started afresh", file=sys.stderr)
        shutil.rmtree(save / CHECKPOINT_DIR)
        (save / "metrics.jsonl").unlink(missing_ok=True)
    elif _interrupted(save):  # a killed run of this job left its log and some outputs, never classifier.json
        print(f"note: --save {save} holds the outputs of an interrupted run of this job (no {CLASSIFIER_FILE}); "
              f"replacing them", file=sys.stderr)
        (save / "metrics.jsonl").unlink(missing_ok=True)
    elif save.is_dir() and any(p.name != LOCK_FILE for p in save.iterdir()):  # a crashed run's lock: not content
        if not (save / CLASSIFIER_FILE).is_file():
            raise OutputError(f"--save {save} holds no {CLASSIFIER_FILE}: it is not a classifier directory of this "
                              f"job, and --force replaces only those; choose a new or empty directory")
        if not args.force:
            changed = changed_settings(save, args)
            what = f"a classifier trained with other settings ({', '.join(changed)})" if changed else "a classifier"
            raise OutputError(f"--save {save} holds {what}; choose a new directory, or pass --force to replace it")
        (save / "metrics.jsonl").unlink(missing_ok=True)  # this job's own log of the run it replaces


# what this job writes into --save (finish.py, saved.py), a temporary of pipeline.job.files starting with "."
_JOB_OUTPUTS = {CHECKPOINT_DIR, "metrics.jsonl", ARGS_FILE, DS_CONFIG_FILE, "eval.json", "per_class_f1.png",
                "dev_predictions.txt", "test_predictions.txt", "thresholds.json", "model.safetensors", "tokenizer",
                "hf", "adapter", LOCK_FILE}


def _interrupted(save: Path) -> bool:
    if not save.is_dir() or (save / CLASSIFIER_FILE).exists():
        return False
    names = [p.name for p in save.iterdir()]
    started = "metrics.jsonl" in names or ARGS_FILE in names  # the first files a run writes
    return started and all(n in _JOB_OUTPUTS or n.startswith(".") for n in names)
