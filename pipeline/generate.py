"""Text from any checkpoint: autoregressive decoding with a KV cache (the mLSTM from its recurrent state).

    python -m pipeline.generate --checkpoint runs/gpt2 --prompt "Once upon a time" --out samples.jsonl
    python -m pipeline.generate --hf exported/ --prompts prompts.txt --greedy --max-new-tokens 32 --out out.jsonl
    torchrun --nproc_per_node 2 -m pipeline.generate --checkpoint runs/gpt2 --tensor-parallel 2 --prompts p.jsonl \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --out out.jsonl

A run saved at any layout generates at ``--tensor-parallel T`` (launch T ranks, like the evaluation). Prompts are
decoded together in batches (left-padded), each until the end-of-text token, ``--max-new-tokens`` or the model's
last position; a single prompt's tokens stream to the terminal. Greedy decoding equals transformers'
``generate(do_sample=False)`` on the export; a seeded sample is the same text at any TP size (docs/generation.md).
The output holds one JSON line per prompt (written atomically, on rank 0; printed to stdout without ``--out``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.job.arguments import add_sampling_args
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.numbers import positive_int


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mds-generate", description=__doc__)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", type=Path,
                       help="a pretraining run (any saved layout), one of its global_step tags, or a project model "
                            "directory (config.json + model.safetensors)")
    model.add_argument("--hf", type=Path, help="a local Hugging Face causal-LM directory of a GPT family")
    p.add_argument("--prompt", help="one prompt (its tokens stream to the terminal)")
    p.add_argument("--prompts", type=Path,
                   help="a file of prompts: one a line, or JSON lines {\"prompt\": ...} in a .jsonl file")
    p.add_argument("--out", type=Path,
                   help="the JSON lines to write, one per prompt (default: print them to stdout; a single prompt's "
                        "tokens then stream to stderr)")
    add_sampling_args(p)
    p.add_argument("--tensor-parallel", type=positive_int, default=1,
                   help="tensor-parallel size to generate at (launch that many ranks; default 1)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts decoded together (default 8)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the model's own)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="weights and compute (default fp32)")
    p.add_argument("--no-cache", action="store_true",
                   help="re-read the whole sequence at every step instead of keeping a KV cache (for comparison)")
    p.add_argument("--quiet", action="store_true", help="no streaming, no progress bar")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    return p


def parse_args(argv: list[str] | None = None):
    return build_parser().parse_args(argv)


@command
def main(argv: list[str] | None = None) -> list[dict]:
    """Generate and write the records (a user error raises; ``command`` reports it in one line, exit 2)."""
    args = parse_args(argv)
    from pipeline.generation.run import run_generation  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_generation(args)


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
