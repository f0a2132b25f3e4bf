"""The end of a finetuning job: thresholds tuned (on dev or a held-out part of train), scores at 0.5 and at
the thresholds, predictions in the E-c format, the per-class chart, the saved classifier and its Hugging Face
export.
"""
from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from finetune.hf_export import ExportError, export_classifier
from finetune.job.loop import dev_loss, full_fp32_state
from finetune.job.providers import Base, Head, Splits
from finetune.model import ENCODER_PREFIX, encoder_type_of
from finetune.job.inputs import first_layers
from finetune.saved import CLASSIFIER_FILE, load_base_state, save_classifier_dir
from finetune.scoring.metrics import (
    evaluate_probabilities,
    format_comparison,
    plot_dev_per_class_f1,
    single_label_scores,
    write_eval_json,
)
from finetune.scoring.predictions import write_predictions
from finetune.scoring.thresholds import apply_thresholds, thresholds_for
from models.lora import is_lora_parameter
from pipeline.hf.peft_adapter import export_peft_adapter, merged_state_dict
from pipeline.job.loop import is_rank0
from pipeline.job.run_dir import changed_settings, next_lines, run_paths, summary_line
from pipeline.tracking.metrics import MetricsWriter


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


def finish(r: FinetuneRun) -> dict:
    args, engine, predict, save, metrics, settings = r.args, r.engine, r.predict, r.save, r.metrics, r.settings
    train, dev, tune_on, test, multilabel = r.data.train, r.data.dev, r.data.tune_on, r.data.test, r.data.multilabel
    config, head_config, tokenizer, max_length = r.base.config, r.head.config, r.base.tokenizer, r.base.max_length
    normalizer = r.data.normalizer

    dev_probs = predict("dev", progress=True)
    tune_probs = dev_probs if tune_on is dev else predict("tune", progress=True)
    test_probs = predict("test", progress=True) if test is not None else None
    thresholds = thresholds_for(tune_on.labels, tune_probs, args.threshold_objective, args.threshold_bagging,
                                args.seed) if multilabel else None
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
    out_record = {"step": settings["steps"], "dev_loss": dev_loss(r.data, dev_probs),
                  **final_dev_record(results["dev"], multilabel)}
    metrics.write(out_record)
    state, adapter = split_lora(full_fp32_state(engine), r.base, args)  # collective: every rank takes part
    out = {"dev": results["dev"], "dev_record": out_record,
           "thresholds": None if thresholds is None else thresholds.tolist(),
           "dev_probabilities": dev_probs, "test_probabilities": test_probs,
           "tune_probabilities": tune_probs, "tune_labels": tune_on.labels}
    if save is None or not is_rank0():
        _barrier()
        return out
    if multilabel:
        systems = {"threshold 0.5": results["dev"]["at_0.5"],
                   f"tuned on {settings['thresholds_tuned_on']}": results["dev"]["tuned"]}
        print(f"dev ({len(dev)} texts):\n" + format_comparison(systems))
        plot_dev_per_class_f1(save / "per_class_f1.png", results["dev"], train.label_names,
                              f"Per-class F1 on dev ({Path(dev.source).name})")
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
    if adapter is not None:
        out["adapter"] = str(export_peft_adapter(save / "adapter", r.base.lora, adapter, r.base.lora_targets,
                                                 force=True))
    metrics.write({"saved": str(save), **({"dev_tuned_micro_f1": results["dev"]["tuned"]["micro_f1"]}
                                          if multilabel else {})})
    if args.hf_export == "auto":
        out["hf_export"] = _export(save)
    _barrier()
    return out


def split_lora(state: dict, base: Base, args) -> tuple[dict, dict | None]:
    """(the classifier's state with --lora's adapters merged into the encoder, the adapters named as on the
    base GPT) or (state, None) without --lora. The frozen encoder is the base as it was read, not its copy
    rounded to the engine's precision."""
    if base.lora is None:
        return state, None
    adapter = {k[len(ENCODER_PREFIX):]: v for k, v in state.items()
               if k.startswith(ENCODER_PREFIX) and is_lora_parameter(k)}
    _, encoder, _ = load_base_state(args.base)
    if args.encoder_layers is not None:
        _, encoder = first_layers(base.config, encoder, args.encoder_layers, args.base)
    merged = merged_state_dict(encoder, adapter, base.lora_targets, base.lora.lora_alpha / base.lora.r)
    head = {k: v for k, v in state.items() if not k.startswith(ENCODER_PREFIX)}
    return {**{ENCODER_PREFIX + k: v for k, v in merged.items()}, **head}, adapter


def final_dev_record(dev: dict, multilabel: bool) -> dict:
    """The last step's dev scores (at 0.5 and with the tuned thresholds), for metrics.jsonl and the monitor."""
    if not multilabel:
        s = dev["single_label"]
        return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"]}
    return {f"dev{tag}_{k}": dev[key][k] for tag, key in (("", "at_0.5"), ("_tuned", "tuned"))
            for k in ("micro_f1", "macro_f1", "jaccard")}


def summary(args, *, first: int, last: int, train_loss: float | None, dev: dict, exported: str | None) -> list[str]:
    """The job's one summary line (steps, the last step's train loss, dev's loss and scores, where the classifier
    is) and the commands that use the classifier next."""
    results = [] if train_loss is None else [f"train loss {train_loss:.4f}"]
    if dev.get("dev_loss") is not None:
        results.append(f"dev loss {dev['dev_loss']:.4f}")
    tuned = "dev_tuned_micro_f1" in dev
    names = (("micro_f1", "micro-F1"), ("macro_f1", "macro-F1"), ("jaccard", "Jaccard")) if tuned else \
        (("accuracy", "accuracy"), ("macro_f1", "macro-F1"))
    prefix = "dev_tuned_" if tuned else "dev_"
    scores = [f"{label} {dev[prefix + key]:.4f}" for key, label in names if prefix + key in dev]
    if scores:
        results.append("dev " + ", ".join(scores) + (" (tuned thresholds)" if tuned else ""))
    if args.save is None:
        return [summary_line(first, last, results, "no classifier saved (no --save)")]
    save = Path(args.save)
    where = f"classifier {save}" + (f", Hugging Face classifier {exported}" if exported else "")
    run, stem = run_paths(save)
    data = shlex.quote(str(args.test or args.dev))
    commands = [f"python -m finetune.predict --model {run} --data {data} --out {stem}-predictions.txt"]
    if args.hf_export == "no":
        commands.append(f"python -m finetune.export_hf --model {run} --out {stem}-hf --verify")
    return [summary_line(first, last, results, where), *next_lines(commands)]


def finished_before(args) -> tuple[list[str], dict] | None:
    """When --save holds the classifier this very command finished (its args.json, no setting changed): the
    lines that say so and its summary, and the job's result (steps, losses, dev scores), read back from
    metrics.jsonl and eval.json; else None (the job runs)."""
    save = Path(args.save) if args.save else None
    if save is None or args.force or args.no_resume or not (save / CLASSIFIER_FILE).is_file() \
            or changed_settings(save, args) != []:
        return None
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()] \
        if (save / "metrics.jsonl").is_file() else []
    steps = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    train = [r["loss"] for r in records if r.get("loss") is not None]
    dev = next((r for r in reversed(records) if r.get("step") == steps and "dev_loss" in r), {})
    hf = save / "hf"
    exported = str(hf) if (hf / "config.json").is_file() else None
    lines = [f"{save} holds the classifier this command finished at step {steps}: nothing to run (--force trains "
             f"it again)",
             *summary(args, first=steps + 1, last=steps, train_loss=train[-1] if train else None, dev=dev,
                      exported=exported)]
    scores = json.loads((save / "eval.json").read_text()).get("dev") if (save / "eval.json").is_file() else None
    return lines, {"finished_before": True, "steps": steps, "losses": train, "dev": scores, "dev_record": dev,
                   "hf_export": exported}


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
