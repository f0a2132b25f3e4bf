"""An ensemble's members: trained here with a recipe (``finetune.job.run``, the finetuning job), gathered from
elsewhere, or the TF-IDF model fitted here; and the one training file and held-out split they must share."""
from __future__ import annotations

import os
from pathlib import Path

from finetune.ensemble.predictor import EnsembleError
from finetune.ensemble.tfidf import TFIDF_FILE, TfidfClassifier
from finetune.job.args import parse_args as parse_finetune_args
from finetune.job.run import run as train_classifier
from finetune.recipes import DEFAULT_HOLDOUT, DEFAULT_HOLDOUT_SEED, RECIPES
from finetune.saved import CLASSIFIER_FILE, LoadedClassifier
from pipeline.job.errors import is_rank0

MEMBERS_DIR = "members"


def train_members(args, save: Path) -> list[Path] | None:
    """The --recipe members, each trained unless already complete in SAVE/members/NAME-SEED; None when a stop
    signal ended the training of one (its state is saved: the same command continues it)."""
    dirs = []
    for name, seed in args.recipes:
        d = save / MEMBERS_DIR / f"{name}-{seed}"
        dirs.append(d)
        if (d / CLASSIFIER_FILE).is_file():
            rank0_print(f"member {d}: already trained, reused")
            continue
        holdout = ["--holdout", str(args.holdout or DEFAULT_HOLDOUT),
                   "--holdout-seed", str(DEFAULT_HOLDOUT_SEED if args.holdout_seed is None else args.holdout_seed)]
        rank0_print(f"member {d}: training recipe {name!r} at seed {seed}")
        result = train_classifier(parse_finetune_args([
            "--base", str(args.base), "--train", str(args.train), "--dev", str(args.dev), "--save", str(d),
            *RECIPES[name], *holdout, "--seed", str(seed), *args.extra]))
        if "stopped_after" in result:  # a stop signal: the member's state is saved; the same command continues
            return None
    return dirs


def common_split(args, members, dirs) -> dict:
    """The training file and held-out split every member shares (their records, the flags, the defaults)."""
    records = [(d, m.info.get("training", {})) if isinstance(m, LoadedClassifier) else (d, m.training)
               for m, d in zip(members, dirs)]
    for d, t in records:
        if t.get("thresholds_tuned_on", "holdout") != "holdout":
            raise EnsembleError(f"{d} tuned its thresholds on dev and trained on all of train: nothing is held out "
                                f"for the ensemble's thresholds; train it with --holdout")
    split = {}
    for key, flag, default in (("train", args.train, None), ("holdout", args.holdout, DEFAULT_HOLDOUT),
                               ("holdout_seed", args.holdout_seed, DEFAULT_HOLDOUT_SEED)):
        seen = {(_same_file_key(t[key]) if key == "train" else t[key]): d for d, t in records if key in t}
        if flag is not None:
            seen.setdefault(_same_file_key(flag) if key == "train" else flag, "--" + key.replace("_", "-"))
        if len(seen) > 1:
            (a, da), (b, db) = list(seen.items())[:2]
            raise EnsembleError(f"{da} and {db} differ in {key} ({a} and {b}): an ensemble's members hold out the "
                                f"same tweets of the same file; retrain with the same --holdout and --holdout-seed")
        if not seen and default is None:
            raise EnsembleError("no member records its training file: give --train")
        split[key] = next(iter(seen)) if seen else default
    split["train"] = str(args.train or next(t["train"] for _, t in records if "train" in t))
    split["dev"] = str(args.dev or next((t["dev"] for _, t in records if t.get("dev")), "")) or None
    if split["dev"] is None:
        raise EnsembleError("no member records its dev file: give --dev")
    return split


def _same_file_key(path: str) -> str:
    return os.path.realpath(path)


def fit_tfidf(save: Path, train, fit_idx, split: dict, normalizer) -> Path:
    d = save / MEMBERS_DIR / "tfidf"
    training = {"train": split["train"], "holdout": split["holdout"], "holdout_seed": split["holdout_seed"],
                "thresholds_tuned_on": "holdout"}
    if (d / TFIDF_FILE).is_file() and TfidfClassifier.load(d).training == training:
        print(f"member {d}: already fitted, reused")
        return d
    print(f"member {d}: fitting TF-IDF + logistic regression on {len(fit_idx)} texts")
    sub = train.subset(fit_idx)
    TfidfClassifier.fit(sub.texts, sub.labels, sub.label_names, normalizer=normalizer, training=training).save(d)
    return d


def rank0_print(message: str) -> None:
    if is_rank0():
        print(message, flush=True)
