"""What ``pipeline.evaluate`` and ``pipeline.sentiment_neuron`` do with their parsed arguments (the commands parse them
without loading torch)."""
from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch
import transformers

from models.mlstm import MLSTM, load_mlstm
from pipeline.checkpoints.checkpoint import is_deepspeed_run_dir, read_full_checkpoint
from pipeline.evaluation.lm_scoring import evaluate_bpc, evaluate_lambada, evaluate_wikitext
from pipeline.evaluation.sentiment_neuron import DEFAULT_CS, run_sentiment_neuron
from pipeline.evaluation.tasks import (MEGATRON_STRIDE, check_outputs, harness_main, load_data, load_model,
                                       plot_loss_by_context, sha256, summary)
from pipeline.hf.convert import short_dtype_name
from pipeline.job.errors import InputError
from pipeline.job.files import atomic_write_json

__all__ = ["run_evaluation", "probe_sentiment_neuron"]


def run_evaluation(args) -> dict:
    """``pipeline.evaluate``: score the model and write the result (a user error raises)."""
    args.dtype = short_dtype_name(args.dtype)
    check_outputs(args)
    for name in ("context_length", "stride", "batch_size", "max_examples", "tensor_parallel", "context_parallel"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.task is not None and args.data is None:
        raise InputError(f"--task {args.task} needs --data (the file to score)")
    if args.harness is not None:
        return harness_main(args)
    data = load_data(args.task, args.data, args.max_examples)  # bad data fails before the model loads
    scorer, tokenizer, shard, is_main, parallel, model_info = load_model(args)

    context_length = args.context_length or scorer.max_positions
    if context_length is None:
        raise InputError(f"{args.hf or args.checkpoint}: the model does not say how many positions it reads; "
                         f"pass --context-length")
    stride = args.stride or min(MEGATRON_STRIDE, context_length)
    settings = {"context_length": context_length, "batch_size": args.batch_size, "dtype": args.dtype,
                "max_examples": args.max_examples, **parallel}
    common = dict(context_length=context_length, batch_size=args.batch_size, shard=shard,
                  progress=is_main and not args.no_progress)

    start = time.perf_counter()
    if args.task == "wikitext":
        results = evaluate_wikitext(scorer, tokenizer, data, stride=stride, **common)
    elif args.task == "lambada":
        results = evaluate_lambada(scorer, tokenizer, data, **common)
    else:
        results = evaluate_bpc(scorer, tokenizer, data, stride=stride, **common)
    elapsed = time.perf_counter() - start
    if args.task != "lambada":
        settings["stride"] = stride

    record = {
        "task": args.task,
        "results": results,
        "settings": settings,
        "model": model_info,
        "tokenizer": tokenizer.name,
        "data": {"path": str(args.data), "sha256": sha256(args.data)},
        "elapsed_s": round(elapsed, 3),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if is_main:
        atomic_write_json(args.out, record)
        if args.plot is not None and "loss_by_context" in results:
            plot_loss_by_context(record, args.plot)
        print(summary(record), file=sys.stderr)
    return record


def probe_sentiment_neuron(args) -> dict:
    """``pipeline.sentiment_neuron``: the probe and the single unit on the mLSTM's features, results written."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if is_deepspeed_run_dir(args.model):  # a pretraining run of the main job (--model-type mlstm)
        config, state, _ = read_full_checkpoint(args.model)
        model = MLSTM(config)
        model.load_state_dict(state)
        model.to(device)
    else:
        model = load_mlstm(args.model, map_location=device)
    Cs = [float(c) for c in args.Cs.split(",")] if args.Cs else list(DEFAULT_CS)
    r = run_sentiment_neuron(model, args.data_dir, args.out, args.batch_size, args.max_length, args.limit, Cs,
                             progress=not args.no_progress, model_name=str(args.model))
    p, u = r["l1_probe"], r["single_unit"]
    print(f"L1 probe (C={p['C']:g}, {p['nonzero_units']} of {r['hidden_size']} units): "
          f"test accuracy {p['test_accuracy']:.4f} (val {p['val_accuracy']:.4f})")
    print(f"single unit {u['unit']} (polarity {u['polarity']:+d}, threshold {u['threshold']:.4g}): "
          f"test accuracy {u['test_accuracy']:.4f} (val {u['val_accuracy']:.4f}); "
          f"majority class {r['majority_class_test_accuracy']:.4f}")
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / r['plot']}")
    return r
