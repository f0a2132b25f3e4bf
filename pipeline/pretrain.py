"""The pretraining main job.

    deepspeed --num_gpus N pipeline/pretrain.py --model-config gpt2-125m \\
        --deepspeed_config ds_configs/bf16_zero2.json --tensor-parallel 2 --pipeline-parallel 1 \\
        --data "corpus/*.txt" --tokenizer path/to/gpt2 --train-steps 1000 --save runs/gpt2 [--load runs/gpt2]

Also runs under ``torchrun``, as ``python -m pipeline.pretrain`` and ``mds-pretrain``; DP is what TP x CP x PP leave.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun: the project root, not pipeline/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pipeline.engine.schedules import add_lr_args
from pipeline.job.arguments import (add_async_save_args, add_checkpoint_args, add_data_args, add_engine_args,
                                    add_model_args, add_run_args, add_sample_args, add_straggler_args,
                                    check_recompute_args)
from pipeline.job.errors import ArgumentParser, command, console_script

__all__ = ["main", "parse_args", "build_parser"]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mds-pretrain", description=__doc__)
    add_model_args(p)
    add_engine_args(p)
    add_data_args(p)
    add_lr_args(p)
    add_run_args(p, add_async_save_args(add_checkpoint_args(p)))
    add_sample_args(p)
    add_straggler_args(p)
    return p


def parse_args(argv=None):
    return check_recompute_args(build_parser().parse_args(argv))


def main(argv=None) -> dict:
    """The job (a user error raises; run as a command, ``pipeline.job.errors.command`` reports it in one line)."""
    args = parse_args(argv)
    from pipeline.pretraining import run_pretraining  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_pretraining(args)


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    command(main)()
