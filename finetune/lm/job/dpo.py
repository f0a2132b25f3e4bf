"""Direct preference optimisation of a language model on chosen / rejected pairs, in full or with LoRA.

    deepspeed --num_gpus N finetune/lm/job/dpo.py --base runs/sft/model --data pairs.jsonl --beta 0.1 \
        --deepspeed_config ds_configs/bf16_zero2.json --tensor-parallel 2 --train-steps 200 --lr 5e-7 --save runs/dpo

Also runs under ``torchrun``, as ``python -m finetune.lm.job.dpo`` and ``mds-dpo``. ``--data`` is JSON lines of
``prompt``, ``chosen``, ``rejected`` (conversations or plain text), tokenized as TRL's ``DPOTrainer`` tokenizes
them; the loss is TRL's sigmoid loss against the frozen base (with LoRA: the policy with its adapters off), and
metrics.jsonl logs rewards/chosen, rewards/rejected, rewards/accuracies and rewards/margins as TRL names them.
Dropout is off, as TRL's default. Runs at TP x DP with ZeRO 0-2; outputs and resuming as ``finetune.lm.job.sft``.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (deepspeed launcher, torchrun): the project root, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[3])

import datasets

from finetune.lm.dpo import tokenize_pairs
from finetune.lm.job.preference import collate, provide_forward
from finetune.lm.job.providers import PostTrainingError, run, start
from finetune.lm.job.options import add_reference_args, post_training_parser
from pipeline.data.build import main_process_first
from pipeline.job.errors import command, console_script
from pipeline.job.numbers import positive_float

__all__ = ["main", "parse_args"]


def parse_args(argv=None):
    p, g = post_training_parser(__doc__, "preference pairs: JSON lines with 'prompt', 'chosen' and 'rejected'")
    g.add_argument("--beta", type=positive_float, default=0.1, help="DPO's beta: how far from the reference the "
                                                                     "policy may move (TRL's default 0.1)")
    add_reference_args(g)
    return p.parse_args(argv)


def provide_pairs(args, base) -> list[dict]:
    """The pairs tokenized (prompt, chosen and rejected ids); a pair longer than --seq-length is refused."""
    with main_process_first():
        pairs = tokenize_pairs(datasets.load_dataset("json", data_files=str(args.data), split="train"),
                               base.tokenizer)
    rows = list(pairs)
    for i, r in enumerate(rows):
        length = len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
        if length > base.config.seq_length:
            raise PostTrainingError(f"{args.data}: pair {i} has {length} tokens, more than --seq-length "
                                    f"{base.config.seq_length}; shorten it or raise --seq-length")
    return rows


@command
def main(argv=None) -> dict:
    """The job (a user error is one line ``error: ...`` and exit code 2)."""
    args = parse_args(argv)
    base, job = start(args, "DPO", dropout=False)
    rows = provide_pairs(args, base)  # with LoRA the reference is the policy with its adapters off
    return run(args, "dpo", base, job, rows, collate(base.pad_id),
               lambda engine: provide_forward(args, base, job, engine, rows), beta=args.beta)


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
