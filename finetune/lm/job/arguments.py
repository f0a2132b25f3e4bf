"""The argument groups of the language-model finetuning commands (``finetune.lm.job.sft``, ``.dpo``) and of LoRA (also
``finetune.train --lora``), named as PEFT's ``LoraConfig`` names them, in a module that imports neither torch nor
PEFT (a parser builds without them; ``finetune.lm.job.options.lora_from_args`` makes the ``LoraConfig``).
"""
from __future__ import annotations

import argparse

from pipeline.engine.schedules import add_lr_args
from pipeline.job.arguments import add_engine_args, add_run_args
from pipeline.job.errors import ArgumentParser
from pipeline.job.numbers import positive_float, positive_int, probability

DEFAULT_RANK, DEFAULT_TARGETS = 8, "all-linear"


def add_lora_args(parser: argparse.ArgumentParser, *, switch: bool = False):
    """LoRA's group. ``switch``: a ``--lora`` flag turns it on (else any ``--lora-*`` flag does)."""
    g = parser.add_argument_group("LoRA (PEFT's LoraConfig; absent: every weight trains)")
    if switch:
        g.add_argument("--lora", action="store_true", help="train low-rank adapters on the encoder's linears, "
                                                           "the base frozen (the head trains in full)")
    g.add_argument("--lora-r", type=positive_int, default=None, help=f"adapter rank (default {DEFAULT_RANK})")
    g.add_argument("--lora-alpha", type=positive_float, default=None, help="scaling alpha (update x alpha / r; "
                                                                           "default 2 x r)")
    g.add_argument("--lora-dropout", type=probability(open_high=True), default=None,
                   help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                   help="Hugging Face module names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; gpt2: "
                        f"c_attn c_proj c_fc) or all-linear (default {DEFAULT_TARGETS})")
    return g


def add_post_training_args(parser: argparse.ArgumentParser, data_help: str):
    """--base, --data, --tokenizer, --seq-length, --epochs, --save, --force, --save-interval, and the memory
    savers --recompute and --loss-chunk-tokens (the pretraining job's, carried by the layout)."""
    g = parser.add_argument_group("model, data and output")
    g.add_argument("--base", required=True, help="base model: a pretraining run of this project, or config.json + "
                                                  "model.safetensors (e.g. pipeline.import_hf's output)")
    g.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory with a chat template "
                                                      "(default: the base's)")
    g.add_argument("--data", required=True, help=data_help)
    g.add_argument("--seq-length", type=positive_int, default=None,
                   help="tokens per row (default: the model's positions, at most 1024)")
    g.add_argument("--epochs", type=positive_float, default=None, help="passes over the data (overrides "
                                                                       "--train-steps)")
    g.add_argument("--save", default=None, help="output directory: metrics.jsonl, checkpoint/ while it runs, then "
                                                "hf/ (and adapter/ with LoRA) and model/")
    g.add_argument("--force", action="store_true", help="replace the outputs in a non-empty --save")
    g.add_argument("--no-resume", action="store_true",
                   help="start a new run: refused when --save already holds files (choose a new directory). Without "
                        "it, the same command again continues an interrupted run in --save")
    g.add_argument("--save-interval", type=positive_int, default=None, metavar="N",
                   help="also save the training state every N steps into SAVE/checkpoint (a stop signal saves it "
                        "anyway); the same command continues an interrupted run from it")
    g.add_argument("--recompute", choices=["none", "full"], default="none",
                   help="full: each transformer layer keeps only its input and runs again in the backward (less "
                        "activation memory, one more forward of the layers; docs/post_training.md)")
    g.add_argument("--loss-chunk-tokens", type=positive_int, default=None, metavar="N",
                   help="the cross-entropy N tokens at a time: its fp32 work tensors are [N, V/TP], never "
                        "[tokens, V/TP]; the same loss")
    return g


def add_reference_args(group) -> None:
    """DPO's reference flags, in the model/data/output group."""
    group.add_argument("--precompute-ref-log-probs", action="store_true",
                       help="compute the reference's log-probabilities of every pair once before training (TRL's "
                            "precompute_ref_log_probs): no reference model in memory while the policy trains; "
                            "written with the pairs to SAVE/reference_logps.jsonl, a --data that needs no reference "
                            "pass (pairs with ref_chosen_logps and ref_rejected_logps use them as given)")


def post_training_parser(description: str, data_help: str, *, prog: str | None = None,
                         pipeline_parallel: bool = False) -> tuple[ArgumentParser, argparse._ArgumentGroup]:
    """The parser of a language-model finetuning command and its model/data/output group (for its own flags);
    ``pipeline_parallel``: it takes --pipeline-parallel (SFT's packed rows on stages)."""
    p = ArgumentParser(prog=prog, description=description)
    g = add_post_training_args(p, data_help)
    add_lora_args(p)
    add_engine_args(p, pipeline_parallel=pipeline_parallel)
    add_lr_args(p)
    add_run_args(p)
    return p, g
