"""Supervised finetuning (instruction tuning) of a language model on conversations, in full or with LoRA.

    deepspeed --num_gpus N finetune/lm/job/sft.py --base runs/smollm2-135m --data chats.jsonl \\
        --deepspeed_config ds_configs/bf16_zero2.json --tensor-parallel 2 --train-steps 500 --lr 2e-4 \\
        --lora-r 16 --lora-alpha 32 --lora-target-modules q_proj v_proj --save runs/sft

Also runs under ``torchrun``, as ``python -m finetune.lm.job.sft`` and ``mds-sft``. ``--data`` is JSON lines with a
``messages`` list of ``{"role", "content"}`` per record, rendered by the tokenizer's own chat template with the
loss on the assistant's tokens only (TRL's ``assistant_only_loss``), packed into rows of --seq-length tokens
with each conversation attending only to itself (docs/post_training.md). Runs at every layout, pipeline stages
included (in full or with LoRA: each stage adapts its own layers).
Writes metrics.jsonl and, at the end, model/, hf/ and with LoRA adapter/ into --save; a stop signal or
--save-interval saves the state into SAVE/checkpoint, and the same command run again continues from it (at any
TP x DP layout: finetune/lm/job/resume.py). --sample-interval writes replies to --sample-prompts as it trains.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (deepspeed launcher, torchrun): the project root, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[3])

from finetune.lm.job.arguments import post_training_parser
from pipeline.job.arguments import add_sample_args
from pipeline.job.errors import job_command

__all__ = ["main", "parse_args"]


def parse_args(argv=None):
    p, _ = post_training_parser(__doc__, "conversations: JSON lines with a 'messages' list of {'role', 'content'} "
                                         "per record", prog="mds-sft", pipeline_parallel=True)
    add_sample_args(p)
    return p.parse_args(argv)


def _job():
    from finetune.lm.job.jobs import run_sft  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_sft


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
