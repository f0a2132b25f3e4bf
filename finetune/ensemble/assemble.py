"""An ensemble assembled from its members: their probabilities on the held-out tweets, dev (and test), the
thresholds of the averaged probabilities tuned on the held-out tweets, the scores, predictions, chart and
``ensemble.json``."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from finetune.data import load_data
from finetune.ensemble.predictor import ENSEMBLE_FILE, Ensemble, check_labels, load_member, save_ensemble_dir
from finetune.ensemble.members import MEMBERS_DIR, common_split, fit_tfidf, train_members
from finetune.ensemble.tfidf import TfidfClassifier
from finetune.job.inputs import holdout_split
from finetune.normalize import TweetNormalizer
from finetune.saved import LoadedClassifier
from finetune.scoring.metrics import evaluate_probabilities, format_comparison, plot_dev_per_class_f1, write_eval_json
from finetune.scoring.predictions import write_predictions
from finetune.scoring.thresholds import THRESHOLDS_FILE, apply_thresholds, thresholds_for
from pipeline.hf.convert import parse_dtype
from pipeline.job.files import OutputError, refuse_overlap

OUTPUTS = {ENSEMBLE_FILE, THRESHOLDS_FILE, "eval.json", "dev_predictions.txt", "test_predictions.txt",
           "per_class_f1.png", MEMBERS_DIR}


def run_ensemble(args) -> dict | None:
    """``finetune.ensemble``: the members trained or gathered, the ensemble built on rank 0 (None on the other ranks
    and after a stop signal)."""
    save = check_save(args)
    trained = train_members(args, save)
    if trained is None:  # stopped by a signal
        return None
    dirs = trained + [Path(m) for m in args.member]
    if dist.is_initialized() and dist.get_rank() != 0:  # the members are trained; rank 0 builds the ensemble
        dist.barrier()
        return None
    result = build(args, save, dirs)
    if dist.is_initialized():
        dist.barrier()
    return result


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
    mean = {name: np.mean(p, axis=0) for name, p in probs.items()}

    def tune(held_probs):  # bootstrap seeded by the split, so a rebuild gives the same thresholds
        return thresholds_for(held.labels, held_probs, args.threshold_objective, args.threshold_bagging,
                              split["holdout_seed"])
    thresholds = tune(mean["held"])
    results = {"dev": evaluate_probabilities(dev.labels, mean["dev"], names, thresholds)}
    if test is not None and test.labels is not None:
        results["test"] = evaluate_probabilities(test.labels, mean["test"], names, thresholds)
    results["members"] = {str(d): evaluate_probabilities(dev.labels, p, names, tune(h))["tuned"]
                          for d, p, h in zip(dirs, probs["dev"], probs["held"])}
    write_outputs(save, results, dev, test, names, mean, len(dirs), thresholds)
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
    return {**results, "thresholds": thresholds, "members": dirs, "dev_probabilities": mean["dev"]}


def write_outputs(save: Path, results: dict, dev, test, names, mean: dict, members: int, thresholds) -> None:
    write_eval_json(save / "eval.json", results)
    write_predictions(save / "dev_predictions.txt", dev.ids, dev.texts, apply_thresholds(mean["dev"], thresholds),
                      names)
    if test is not None:
        write_predictions(save / "test_predictions.txt", test.ids, test.texts,
                          apply_thresholds(mean["test"], thresholds), names)
    plot_dev_per_class_f1(save / "per_class_f1.png", results["dev"], names,
                          f"Ensemble of {members}: per-class F1 on dev ({Path(dev.source).name})")
