"""Supervised finetuning (instruction tuning) of a language model on conversations, in full or with LoRA.

    deepspeed --num_gpus N finetune/lm/job/sft.py --base runs/smollm2-135m --data chats.jsonl \
        --deepspeed_config ds_configs/bf16_zero2.json --tensor-parallel 2 --train-steps 500 --lr 2e-4 \
        --lora-r 16 --lora-alpha 32 --lora-target-modules q_proj v_proj --save runs/sft

Also runs under ``torchrun``, as ``python -m finetune.lm.job.sft`` and ``mds-sft``. ``--data`` is JSON lines with a
``messages`` list of ``{"role", "content"}`` per record, rendered by the tokenizer's own chat template with the
loss on the assistant's tokens only (TRL's ``assistant_only_loss``), packed into rows of --seq-length tokens
with each conversation attending only to itself (docs/post_training.md). Runs at TP x DP with ZeRO 0-2.
Writes metrics.jsonl and, at the end, model/, hf/ and with LoRA adapter/ into --save; a stop signal or
--save-interval saves the state into SAVE/checkpoint, and the same command run again continues from it (at any
TP x DP layout: finetune/lm/job/resume.py). --sample-interval writes replies to --sample-prompts as it trains.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (deepspeed launcher, torchrun): the project root, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[3])

from finetune.lm.chat import load_conversations, tokenize_conversations, training_chat_template
from finetune.lm.job.providers import run, start
from finetune.lm.job.samples import chat_sample_hooks
from finetune.lm.job.options import post_training_parser
from finetune.lm.packing import collate, pack_conversations
from finetune.lm.sft import sft_loss
from pipeline.data.build import main_process_first
from pipeline.generation.training import add_sample_args
from pipeline.job.errors import command, console_script

__all__ = ["main", "parse_args"]


def parse_args(argv=None):
    p, _ = post_training_parser(__doc__, "conversations: JSON lines with a 'messages' list of {'role', 'content'} "
                                         "per record")
    add_sample_args(p)
    return p.parse_args(argv)


def provide_rows(args, base) -> list[dict]:
    """The conversations rendered (assistant-only labels) and packed into rows of --seq-length tokens."""
    template = training_chat_template(base.tokenizer, f"--tokenizer {base.tokenizer_dir}")
    with main_process_first():
        tokenized = tokenize_conversations(load_conversations(args.data), base.tokenizer, template)
        return list(pack_conversations(tokenized, base.config.seq_length))


def sft_forward(engine, batch) -> dict:
    """The mean loss over the micro-batch's assistant tokens (the packed path: ``engine.module`` itself, its
    gradients reduced by ``engine.backward``)."""
    batch = batch.to(engine.device)
    return {"loss": sft_loss(engine.module, batch), "tokens": batch.num_targets}


@command
def main(argv=None) -> dict:
    """The job (a user error is one line ``error: ...`` and exit code 2)."""
    args = parse_args(argv)
    base, job = start(args, "SFT")
    return run(args, "sft", base, job, provide_rows(args, base),
               lambda rows: collate(rows, base.config.seq_length, base.pad_id), lambda engine: sft_forward,
               lambda engine: chat_sample_hooks(args, engine, base, job))


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
