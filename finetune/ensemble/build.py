"""Train or gather an ensemble's members, tune its thresholds on their common held-out tweets, score it, save it.

    python -m finetune.ensemble --save runs/ec-ensemble --base runs/smollm2-135m \\
        --train E-c-train.tsv --dev E-c-dev.tsv \\
        --recipe labels:1234 --recipe labels:7 --recipe last:1234 --tfidf          # finetune.recipes.EC_ENSEMBLE
    python -m finetune.ensemble --save runs/ec-mix --member runs/ec-a --member runs/ec-b --tfidf   # gathered

``--recipe NAME:SEED`` trains a member with ``finetune/train.py``, recipe NAME (``finetune.recipes.RECIPES``)
and ``--seed SEED``, in this process (the deepspeed launcher's ranks train it together), into
``SAVE/members/NAME-SEED``; a member already complete there is reused, so the rerun of an interrupted command
trains only what is missing. Arguments after ``--`` go to every trained member (``-- --deepspeed_config
ds_configs/bf16_zero1.json``). ``--member DIR`` adds a classifier or TF-IDF model trained elsewhere. ``--tfidf``
fits the TF-IDF model (``finetune.ensemble.tfidf``) on the members' training part, into ``SAVE/members/tfidf``.

Every member must hold out the same tweets of the same training file (the same ``--holdout`` and
``--holdout-seed``; the recipes' defaults agree), and none may have tuned on dev. The ensemble's probabilities
are the mean of its members'; its per-class thresholds are tuned on the held-out tweets
(``--threshold-objective``, ``--threshold-bagging``: the recipes'), never on dev. Writes ``thresholds.json``,
``eval.json`` (the ensemble's and each member's dev scores, members tuned the same way), ``dev_predictions.txt``
(and ``test_predictions.txt`` with ``--test``), ``per_class_f1.png`` and, last, ``ensemble.json``.
``finetune.predict --model SAVE`` serves it. The ensemble has no ``transformers`` export: a member trained
with the last-token recipe has its own (``SAVE/members/last-SEED/hf``).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from finetune.data import SEMEVAL_EC_LABELS, load_data
from finetune.ensemble import ENSEMBLE_FILE, Ensemble, EnsembleError, check_labels, load_member, save_ensemble_dir
from finetune.job.args import parse_args as parse_finetune_args
from finetune.job.inputs import holdout_split
from finetune.normalize import TweetNormalizer
from finetune.recipes import RECIPES
from finetune.saved import CLASSIFIER_FILE, LoadedClassifier
from finetune.scoring.metrics import (PUBLISHED_EC_TEST_F1, evaluate_probabilities, format_comparison,
                                      plot_per_class_f1, write_eval_json)
from finetune.scoring.predictions import write_predictions
from finetune.scoring.thresholds import THRESHOLDS_FILE, apply_thresholds, bagged_thresholds, tune_thresholds
from finetune.ensemble.tfidf import TFIDF_FILE, TfidfClassifier
from finetune.train import run as train_classifier
from pipeline.hf.convert import add_dtype_arg, parse_dtype
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.files import OutputError, refuse_overlap

MEMBERS_DIR = "members"
OUTPUTS = {ENSEMBLE_FILE, THRESHOLDS_FILE, "eval.json", "dev_predictions.txt", "test_predictions.txt",
           "per_class_f1.png", MEMBERS_DIR}
DEFAULT_HOLDOUT, DEFAULT_HOLDOUT_SEED = 0.1, 1234


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = ArgumentParser(prog="python -m finetune.ensemble", description=__doc__)
    p.add_argument("--save", required=True, help="ensemble directory to write (new, or one this command wrote)")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME:SEED",
                   help=f"train a member: recipe NAME ({', '.join(RECIPES)}) at --seed SEED (repeatable)")
    p.add_argument("--member", action="append", default=[], metavar="DIR",
                   help="a classifier (finetune/train.py --save) or TF-IDF model trained elsewhere (repeatable)")
    p.add_argument("--tfidf", action="store_true", help="fit the TF-IDF model on the members' training part")
    p.add_argument("--base", default=None, help="base model of the trained members (with --recipe)")
    p.add_argument("--train", default=None, help="training file (default: the one the members record)")
    p.add_argument("--dev", default=None, help="dev file scored (default: the one the members record)")
    p.add_argument("--test", default=None, help="also predict (and score, if labelled) this file")
    p.add_argument("--holdout", type=float, default=None,
                   help=f"held-out fraction of train (default: the members', else {DEFAULT_HOLDOUT})")
    p.add_argument("--holdout-seed", type=int, default=None,
                   help=f"seed of the held-out split (default: the members', else {DEFAULT_HOLDOUT_SEED})")
    p.add_argument("--threshold-objective", choices=["micro", "macro", "balanced", "mean"], default="mean")
    p.add_argument("--threshold-bagging", type=int, default=100, metavar="N",
                   help="average the thresholds over N bootstrap resamples of the held-out tweets (0: no bagging)")
    p.add_argument("--batch-size", type=int, default=64)
    add_dtype_arg(p, default="bfloat16", help="dtype the members compute their probabilities in")
    p.add_argument("--force", action="store_true", help="rebuild an ensemble this command wrote in --save")
    args = p.parse_args(argv)
    args.extra = extra
    args.recipes = [_recipe(p, spec) for spec in args.recipe]
    if not args.recipes and not args.member:
        p.error("no members: give --recipe NAME:SEED and/or --member DIR")
    if args.recipes and not (args.base and args.train and args.dev):
        p.error("--recipe trains members: give --base, --train and --dev")
    if args.holdout is not None and not 0.0 < args.holdout < 1.0:
        p.error(f"--holdout must be in (0, 1), got {args.holdout}")
    if len(args.recipes) + len(args.member) + args.tfidf < 2:
        p.error("an ensemble needs at least two members")
    return args


def _recipe(p, spec: str) -> tuple[str, int]:
    name, _, seed = spec.partition(":")
    if name not in RECIPES or not seed.lstrip("-").isdigit():
        p.error(f"--recipe {spec!r}: expected NAME:SEED with NAME one of {', '.join(RECIPES)} and SEED an integer")
    return name, int(seed)


def check_save(args) -> Path:
    """--save holds nothing but this command's outputs; an earlier ensemble is rebuilt only with --force
    (its members are kept and reused)."""
    save = Path(args.save)
    refuse_overlap(save, [("--base", args.base), ("--train", args.train), ("--dev", args.dev), ("--test", args.test),
                          *(("--member", m) for m in args.member)], "--save")
    if save.exists() and not save.is_dir():
        raise OutputError(f"--save {save} is a file; give a directory")
    if save.is_dir():
        foreign = sorted(p.name for p in save.iterdir() if p.name not in OUTPUTS and not p.name.startswith("."))
        if foreign:
            raise OutputError(f"--save {save} holds {', '.join(foreign[:5])}, which this command did not write; "
                              f"choose a new directory")
        if (save / ENSEMBLE_FILE).is_file() and not args.force:
            raise OutputError(f"--save {save} already holds an ensemble; pass --force to rebuild it (its members "
                              f"are reused) or choose a new directory")
    return save


# ------------------------------------------------------------------------------------------------ members

def train_members(args, save: Path) -> list[Path]:
    """The --recipe members, each trained unless already complete in SAVE/members/NAME-SEED."""
    dirs = []
    for name, seed in args.recipes:
        d = save / MEMBERS_DIR / f"{name}-{seed}"
        dirs.append(d)
        if (d / CLASSIFIER_FILE).is_file():
            _rank0_print(f"member {d}: already trained, reused")
            continue
        holdout = ["--holdout", str(args.holdout or DEFAULT_HOLDOUT),
                   "--holdout-seed", str(DEFAULT_HOLDOUT_SEED if args.holdout_seed is None else args.holdout_seed)]
        _rank0_print(f"member {d}: training recipe {name!r} at seed {seed}")
        train_classifier(parse_finetune_args([
            "--base", str(args.base), "--train", str(args.train), "--dev", str(args.dev), "--save", str(d),
            *RECIPES[name], *holdout, "--seed", str(seed), *args.extra]))
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


# ------------------------------------------------------------------------------------------------ the ensemble

def tune(labels, probs, args, seed: int) -> np.ndarray:
    refine = None if args.threshold_objective == "macro" else args.threshold_objective
    if args.threshold_bagging:
        return bagged_thresholds(labels, probs, refine=refine, resamples=args.threshold_bagging, seed=seed)
    return tune_thresholds(labels, probs, refine=refine)


def build(args, save: Path, dirs: list[Path]) -> dict:
    dtype = parse_dtype(args.dtype)
    members = [load_member(d, dtype) for d in dirs]
    split = common_split(args, members, dirs)
    train, dev = load_data(split["train"]), load_data(split["dev"])
    test = load_data(args.test) if args.test else None
    fit_idx, held_idx = holdout_split(len(train), split["holdout"], split["holdout_seed"])
    if args.tfidf:
        normalizer = next((m.info["normalizer"] for m in members if isinstance(m, LoadedClassifier)), TweetNormalizer())
        dirs = [*dirs, fit_tfidf(save, train, fit_idx, split, normalizer)]
        members.append(TfidfClassifier.load(dirs[-1]))
    names = check_labels(members, dirs, train.label_names)
    held = train.subset(held_idx)
    ensemble = Ensemble(members, dirs, None)
    t0 = time.perf_counter()
    probs = {name: ensemble.member_probabilities(data.texts, args.batch_size, progress=True)
             for name, data in (("held", held), ("dev", dev), ("test", test)) if data is not None}
    seconds = time.perf_counter() - t0
    seed = split["holdout_seed"]  # the bootstrap resamples of the held-out tweets, as the members drew theirs
    thresholds = tune(held.labels, np.mean(probs["held"], axis=0), args, seed)
    results = {"dev": evaluate_probabilities(dev.labels, np.mean(probs["dev"], axis=0), names, thresholds)}
    if test is not None and test.labels is not None:
        results["test"] = evaluate_probabilities(test.labels, np.mean(probs["test"], axis=0), names, thresholds)
    results["members"] = {str(d): evaluate_probabilities(dev.labels, p, names,
                                                         tune(held.labels, h, args, seed))["tuned"]
                          for d, p, h in zip(dirs, probs["dev"], probs["held"])}
    write_outputs(save, results, dev, test, names, probs, thresholds)
    info = {"split": split, "threshold_objective": args.threshold_objective,
            "threshold_bagging": args.threshold_bagging, "held_out_texts": len(held),
            "dev_tuned": {k: results["dev"]["tuned"][k] for k in ("micro_f1", "macro_f1", "jaccard")}}
    save_ensemble_dir(save, dirs, names, thresholds, **info)
    shown = [Path(d).name for d in results["members"]]
    shown = shown if len(set(shown)) == len(shown) else ["/".join(Path(d).parts[-2:]) for d in results["members"]]
    systems = {**dict(zip(shown, results["members"].values())), "ensemble": results["dev"]["tuned"]}
    print(f"dev ({len(dev)} texts), every threshold tuned on the {len(held)} held-out training texts:\n"
          + format_comparison(systems))
    print(f"wrote the ensemble of {len(dirs)} members to {save} (predictions {seconds:.0f} s)")
    return {**results, "thresholds": thresholds, "members": dirs, "dev_probabilities": np.mean(probs["dev"], 0)}


def write_outputs(save: Path, results: dict, dev, test, names, probs, thresholds) -> None:
    write_eval_json(save / "eval.json", results)
    write_predictions(save / "dev_predictions.txt", dev.ids, dev.texts,
                      apply_thresholds(np.mean(probs["dev"], axis=0), thresholds), names)
    if test is not None:
        write_predictions(save / "test_predictions.txt", test.ids, test.texts,
                          apply_thresholds(np.mean(probs["test"], axis=0), thresholds), names)
    published = PUBLISHED_EC_TEST_F1 if set(names) <= set(SEMEVAL_EC_LABELS) else None
    plot_per_class_f1(save / "per_class_f1.png", results["dev"], reference=published,
                      reference_label="Kant et al. 2018, E-c test (the values the paper gives)",
                      title=f"Ensemble of {len(probs['dev'])}: per-class F1 on dev ({Path(dev.source).name})")


def _rank0_print(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


@command
def main(argv=None) -> dict | None:
    args = parse_args(argv)
    save = check_save(args)
    dirs = train_members(args, save) + [Path(m) for m in args.member]
    if dist.is_initialized() and dist.get_rank() != 0:  # the members are trained; rank 0 builds the ensemble
        dist.barrier()
        return None
    result = build(args, save, dirs)
    if dist.is_initialized():
        dist.barrier()
    return result


cli = console_script(main)

if __name__ == "__main__":
    main()
