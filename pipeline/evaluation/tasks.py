"""What ``python -m pipeline.evaluate`` does with its arguments: the task's data, the model (a local
Hugging Face directory or GGUF file, or a project checkpoint at any TP size), lm-evaluation-harness tasks,
the summary line and the loss-by-context plot.
"""
from __future__ import annotations

import datetime
import hashlib
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import lm_eval
import matplotlib
import matplotlib.pyplot as plt

from models.parallel import get_parallel_state
from pipeline.engine.distributed import init_distributed
from pipeline.job.arguments import EVALUATION_TASKS as TASKS, MEGATRON_STRIDE  # noqa: F401 (re-exported)
from pipeline.job.errors import InputError
from pipeline.job.files import atomic_path, atomic_write_json, check_output_file, refuse_overlap
from pipeline.evaluation.lm_scoring import (DataShard, load_hf_model, load_hf_tokenizer, load_lambada,
                                            load_project_model, load_text, load_wikitext, project_scorer)
from pipeline.evaluation.harness import ProjectLM, run_harness



def load_data(task: str, path: Path, max_examples: int | None):
    if task == "wikitext":
        return load_wikitext(path, max_articles=max_examples)
    if task == "lambada":
        return load_lambada(path, max_examples=max_examples)
    return load_text(path, max_lines=max_examples)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_outputs(args) -> None:
    """--out and --plot: never an input (or a directory holding one); an existing file only with --force."""
    inputs = [("--data", args.data), ("--hf", args.hf), ("--checkpoint", args.checkpoint),
              ("--tokenizer", args.tokenizer), ("--include-path", args.include_path)]
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            refuse_overlap(path, inputs, flag)
            check_output_file(path, args.force, flag)


def load_model(args):
    """(scorer, tokenizer, data shard, is_main, layout, description) for --hf or --checkpoint."""
    if args.hf is not None and args.context_parallel != 1:
        raise InputError(f"--context-parallel {args.context_parallel}: splits a --checkpoint's windows over ranks; "
                         f"--hf runs in one process, drop --context-parallel")
    if args.hf is not None:
        scorer, model_info = load_hf_model(args.hf, dtype=args.dtype, device=args.device,
                                           trust_remote_code=args.trust_remote_code)
        tokenizer = load_hf_tokenizer(args.tokenizer or args.hf, trust_remote_code=args.trust_remote_code)
        shard, is_main, parallel = DataShard(), True, {"tensor_parallel": 1, "data_parallel": 1}
    else:
        init_distributed()
        model, tokenizer = load_project_model(args.checkpoint, args.tensor_parallel,
                                              context_parallel=args.context_parallel)
        if args.dtype != "fp32":
            model.to(dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
        if args.tokenizer is not None:
            tokenizer = load_hf_tokenizer(args.tokenizer)
        scorer, shard, is_main = project_scorer(model), DataShard.current(), dist.get_rank() == 0
        state = get_parallel_state()
        parallel = {"tensor_parallel": state.tensor_parallel, "context_parallel": state.context_parallel,
                    "data_parallel": state.data_parallel}
        model_info = {"source": str(args.checkpoint), "format": "project", "dtype": args.dtype,
                      "parameters": model.config.num_parameters(), "max_positions": scorer.max_positions}
    return scorer, tokenizer, shard, is_main, parallel, model_info


def harness_main(args) -> dict:
    """lm-evaluation-harness tasks through the project's adapter (pipeline.evaluation.harness)."""
    tasks = [t.strip() for t in args.harness.split(",") if t.strip()]
    if args.include_path is not None and not args.include_path.is_dir():
        raise InputError(f"--include-path {args.include_path}: not a folder; give the folder of task YAML files")
    scorer, tokenizer, shard, is_main, parallel, model_info = load_model(args)
    max_length = args.context_length or scorer.max_positions
    lm = ProjectLM(scorer, tokenizer.tokenizer, max_length, batch_size=args.batch_size, shard=shard,
                   name=str(args.hf or args.checkpoint))
    start = time.perf_counter()
    out = run_harness(lm, tasks, include_path=args.include_path, limit=args.max_examples,
                      num_fewshot=args.num_fewshot, log_samples=args.log_samples)
    record = {"harness": tasks, **out, "model": model_info,
              "settings": {"context_length": max_length, "batch_size": args.batch_size, "dtype": args.dtype,
                           "max_examples": args.max_examples, **parallel},
              "elapsed_s": round(time.perf_counter() - start, 3),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "lm_eval": lm_eval.__version__}}
    if is_main:
        atomic_write_json(args.out, record)
        for task, metrics in out["results"].items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"{task}: {shown}", file=sys.stderr)
    return record


def plot_loss_by_context(record: dict, path: Path) -> None:
    """Mean token loss against the left context it was scored with (how much the window length matters)."""
    matplotlib.use("Agg")
    rows = record["results"]["loss_by_context"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([math.sqrt(r["context_from"] * r["context_to"]) for r in rows], [r["mean_nll"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens of left context")
    ax.set_ylabel("mean token NLL (nats)")
    s = record["settings"]
    ax.set_title(f"{record['task']}: {Path(record['model']['source']).name}\n"
                 f"context {s['context_length']}, stride {s['stride']}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)


def summary(record: dict) -> str:
    r, task = record["results"], record["task"]
    if task == "wikitext":
        text = (f"token perplexity {r['token_perplexity']:.3f}, word perplexity {r['word_perplexity']:.3f} "
                f"({r['num_scored_tokens']} tokens, {r['num_words']} words)")
    elif task == "lambada":
        text = (f"strict accuracy {r['accuracy']:.4f} ({r['num_correct']}/{r['num_examples']}), "
                f"token accuracy {r['token_accuracy']:.4f} ({r['num_correct_tokens']}/{r['num_target_tokens']})")
    else:
        text = (f"{r['bits_per_character']:.4f} bits/char, {r['bits_per_byte']:.4f} bits/byte "
                f"({r['num_characters']} characters)")
    return f"{task}: {text}; {record['elapsed_s']:.1f}s"
