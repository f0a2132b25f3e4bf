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
from pathlib import Path

from pipeline.job.arguments import EVALUATION_TASKS, MEGATRON_STRIDE, add_dtype_arg
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.numbers import non_negative_int, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mds-evaluate", description=__doc__)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", choices=EVALUATION_TASKS, help="the project's own evaluations (with --data)")
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
    from pipeline.evaluation.run import run_evaluation  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_evaluation(args)


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    command(main)()
