"""Direct preference optimisation of a language model on chosen / rejected pairs, in full or with LoRA.

    deepspeed --num_gpus N finetune/lm/job/dpo.py --base runs/sft/model --data pairs.jsonl --beta 0.1 \\
        --deepspeed_config ds_configs/bf16_zero2.json --tensor-parallel 2 --train-steps 200 --lr 5e-7 --save runs/dpo

Also runs under ``torchrun``, as ``python -m finetune.lm.job.dpo`` and ``mds-dpo``. ``--data`` is JSON lines of
``prompt``, ``chosen``, ``rejected`` (conversations or plain text), tokenized as TRL's ``DPOTrainer`` tokenizes
them; the loss is TRL's sigmoid loss against the frozen base (with LoRA: the policy with its adapters off), and
metrics.jsonl logs rewards/chosen, rewards/rejected, rewards/accuracies and rewards/margins as TRL names them.
Dropout is off, as TRL's default. Runs at every layout but pipeline stages (docs/post_training.md);
outputs and resuming as ``finetune.lm.job.sft``.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (deepspeed launcher, torchrun): the project root, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[3])

from finetune.lm.job.arguments import add_reference_args, post_training_parser
from pipeline.job.errors import job_command
from pipeline.job.numbers import positive_float

__all__ = ["main", "parse_args"]


def parse_args(argv=None):
    p, g = post_training_parser(__doc__, "preference pairs: JSON lines with 'prompt', 'chosen' and 'rejected'",
                                prog="mds-dpo")
    g.add_argument("--beta", type=positive_float, default=0.1, help="DPO's beta: how far from the reference the "
                                                                     "policy may move (TRL's default 0.1)")
    add_reference_args(g)
    return p.parse_args(argv)


def _job():
    from finetune.lm.job.jobs import run_dpo  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_dpo


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
