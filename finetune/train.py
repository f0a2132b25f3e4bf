"""The finetuning job: a text classifier (multilabel emotions, or single-label) on a pretrained project model.

    deepspeed --num_gpus N finetune/train.py --base runs/gpt2 --train E-c-train.tsv --dev E-c-dev.tsv \\
        --deepspeed_config ds_configs/bf16_zero1.json --tensor-parallel 2 --global-batch-size 32 \\
        --epochs 3 --lr 3e-5 --save runs/ec [--test E-c-test.tsv] [--labels plutchik]

Also runs under ``torchrun`` and as ``python -m finetune.train`` (one process). ``--base`` is a pretraining
run of this project (a GPT saved at any TP/PP layout, or an mLSTM), a ``config.json`` + ``model.safetensors``
directory (e.g. an imported Hugging Face model) or a finetuned classifier. Texts are tokenised with the base
model's tokenizer. The GPT runs at any tensor-parallel size (pipeline parallelism is not used for finetuning);
the mLSTM is data-parallel only and classifies from its final cell state.

Writes into ``--save``: the classifier (classifier.json, model.safetensors as a full TP=1 state dict,
thresholds.json tuned on dev or on a held-out part of train, tokenizer/), metrics.jsonl, eval.json (scores at
0.5 and at the tuned thresholds), per_class_f1.png, predictions in the official E-c format
(dev_predictions.txt, test_predictions.txt) and, when the head is one Hugging Face can hold, the exported
``transformers`` classifier in hf/. A stop signal (SIGTERM, SIGUSR1) or ``--save-interval`` saves the training
state into SAVE/checkpoint; the same command run again continues from it (``finetune.job.resume``).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun: the project root, not finetune/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from finetune.job import args as job_args
from pipeline.job.errors import job_command


def parse_args(argv=None):
    return job_args.parse_args(argv, description=__doc__)


def _job():
    from finetune.job.run import run  # noqa: PLC0415  (deferred: --help must not load torch)
    return run


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
