"""Score a language model as Megatron-LM reports it: WikiText perplexity, LAMBADA accuracy, bits per character.

    python -m pipeline.evaluate --task wikitext --data wiki.test.tokens --hf MODEL_DIR --out result.json
    python -m pipeline.evaluate --task lambada --data lambada/test.jsonl --hf model.gguf --dtype bf16 --out r.json
    python -m pipeline.evaluate --task bpc --data held_out.txt --hf MODEL_DIR --out r.json
    deepspeed --num_gpus 8 -m pipeline.evaluate --task wikitext ... --checkpoint CKPT_DIR   # project checkpoints
    python -m pipeline.evaluate --harness lambada_openai,hellaswag --checkpoint RUN [--include-path DIR] --out r.json

``--hf`` takes a local Hugging Face directory or GGUF file (nothing is downloaded;
remote code only with --trust-remote-code). The result JSON (written atomically)
holds the numbers, the counts they come from, and every setting.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import transformers

from pipeline.job.errors import ArgumentParser, InputError, command, console_script
from pipeline.job.files import atomic_write_json
from pipeline.job.numbers import non_negative_int, positive_int
from pipeline.hf.convert import add_dtype_arg, short_dtype_name
from pipeline.evaluation.lm_scoring import evaluate_bpc, evaluate_lambada, evaluate_wikitext
from pipeline.evaluation.tasks import (MEGATRON_STRIDE, TASKS, check_outputs, harness_main, load_data, load_model,
                                       plot_loss_by_context, sha256, summary)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m pipeline.evaluate", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", choices=TASKS, help="the project's own evaluations (with --data)")
    what.add_argument("--harness", metavar="TASKS",
                      help="lm-evaluation-harness tasks, comma-separated (e.g. lambada_openai,hellaswag): the "
                           "harness's own task definitions and metrics on this model, no export needed")
    p.add_argument("--data", type=Path,
                   help="--task: wikitext: a WikiText file (wiki.test.tokens / test.txt, or wiki.test.raw); "
                        "lambada: JSON lines {\"text\": ...}; bpc: any UTF-8 text file")
    p.add_argument("--include-path", type=Path,
                   help="--harness: a folder of task YAML files (e.g. tasks reading local data files, offline)")
    p.add_argument("--num-fewshot", type=non_negative_int,
                   help="--harness: few-shot examples (default: each task's own)")
    p.add_argument("--log-samples", action="store_true",
                   help="--harness: also write each request's answers (log-likelihood, greedy) to the JSON")
    p.add_argument("--out", required=True, type=Path, help="result JSON file")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", type=Path, help="Hugging Face causal-LM directory or .gguf file")
    model.add_argument("--checkpoint", type=Path, help="project checkpoint directory")
    p.add_argument("--tensor-parallel", type=positive_int, default=1,
                   help="--checkpoint: tensor-parallel size to score with (launch TP x DP ranks like the main job)")
    p.add_argument("--context-parallel", type=positive_int, default=1,
                   help="--checkpoint: split each window over C ranks (DeepSpeed-Ulysses; launch TP x C x DP ranks)")
    p.add_argument("--tokenizer", type=Path,
                   help="tokenizer directory or .gguf file (default: the model's own)")
    p.add_argument("--context-length", type=positive_int,
                   help="tokens the model reads per window (default: the model's maximum positions)")
    p.add_argument("--stride", type=positive_int,
                   help=f"wikitext/bpc: new tokens scored per window; smaller gives each token more context "
                        f"and costs more (default: Megatron's {MEGATRON_STRIDE}, capped at --context-length)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="windows (wikitext, bpc) or passages (lambada) per forward (default: 8)")
    p.add_argument("--max-examples", type=positive_int,
                   help="score a prefix only: the first N passages (lambada), articles (wikitext) or lines (bpc)")
    add_dtype_arg(p, default="fp32", help="model weights and compute")
    p.add_argument("--device", default="auto",
                   help="auto (cuda if there is one), cpu, cuda, cuda:1 ... (--hf only; default: auto)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the model directory's own Python code (off by default)")
    p.add_argument("--plot", type=Path, help="wikitext/bpc: also save a PNG of the loss against the left context")
    p.add_argument("--force", action="store_true", help="replace an existing --out / --plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None):
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Score and write the result (a user error raises; ``python -m`` reports it in one line, exit 2)."""
    args = build_parser().parse_args(argv)
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


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    command(main)()
