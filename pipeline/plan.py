"""The layout planner: for a model on N GPUs of a named server type, every feasible (TP, PP, DP, ZeRO stage,
sequence parallelism, recomputation, micro-batch), its memory per GPU, headroom and predicted step time, fastest
first (rows that print the same numbers folded into one); then which limit binds the first (memory, the pipeline
bubble, communication) and the ``deepspeed`` command line of pipeline/pretrain.py that trains it.
No GPU is needed (docs/performance.md: the model, its assumptions, its validation).

    python -m pipeline.plan --model-config llama-8b --gpus 64 --hardware h200-dgx --seq-length 4096 \\
        --global-batch-size 1024 [--tp 8 --pp 1 --zero 1 --recompute selective --micro-batch 1] [--top 10]
        (--recompute-modules core_attn,mlp_act,layernorm pins what selective recomputes)
    python -m pipeline.plan --validate [--plot validation.png]  # against Megatron-LM (2019) and the mLSTM
        paper (2018); exit 1 if a row is off
    python -m pipeline.plan --list-hardware
"""
from __future__ import annotations

from pipeline.job.arguments import RECOMPUTE_POLICIES, recompute_modules_arg
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.numbers import float_in, int_in, positive_float, positive_int

# the planner's own values (pipeline.planning.memory / layouts load torch; tests/test_cli_parsers.py checks these)
PRECISIONS = ("bf16", "fp16", "fp32")
DEFAULT_BUCKET = 5e8  # DeepSpeed's reduce_bucket_size (elements)
MAX_GPUS = 2**20  # beyond any cluster: the search enumerates the divisors of the GPU count and of the batch
MAX_SIZE = 2**30


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mds-plan", description=__doc__)
    p.add_argument("--model-config", help="a JSON file or a preset of models/configs/ (gpt or mlstm)")
    p.add_argument("--gpus", type=int_in(1, MAX_GPUS), help=f"how many GPUs (at most {MAX_GPUS})")
    p.add_argument("--hardware", default="h100-dgx", help="a profile of pipeline/planning/hardware.json")
    p.add_argument("--seq-length", type=int_in(1, MAX_SIZE), help="tokens per sequence (default: the config's)")
    p.add_argument("--global-batch-size", type=int_in(1, MAX_SIZE),
                   help="sequences per optimizer step (default: max(gpus, 8))")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="training precision: weights and gradients in it (2 bytes each in bf16/fp16, 4 in fp32), "
                        "Adam's moments in fp32 (and fp32 master weights with bf16/fp16)")
    p.add_argument("--sustained-tflops", type=positive_float, help="the matmul rate per GPU (default: the profile's)")
    p.add_argument("--bucket", type=float_in(1, MAX_SIZE), default=DEFAULT_BUCKET,
                   help="DeepSpeed's reduce_bucket_size (elements)")
    g = p.add_argument_group("pin a part of the layout")
    g.add_argument("--tp", type=int_in(1, MAX_GPUS),
                   help="tensor-parallel size (a divisor of --gpus and of the heads; default: every one that fits)")
    g.add_argument("--pp", type=int_in(1, MAX_GPUS),
                   help="pipeline-parallel stages (at most the layers; default: every divisor of --gpus / TP)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="DeepSpeed's ZeRO stage (2 and 3 only without a pipeline; default: every one)")
    g.add_argument("--sp", choices=["on", "off"], help="sequence parallelism (with TP > 1; default: both)")
    g.add_argument("--recompute", choices=RECOMPUTE_POLICIES, help="activation recomputation policy (default: each)")
    g.add_argument("--recompute-modules", type=recompute_modules_arg,
                   help="what selective recomputes: core_attn and/or mlp_act, layernorm (a comma list; the planner "
                        "tries core_attn alone and all three)")
    g.add_argument("--micro-batch", type=int_in(1, MAX_SIZE),
                   help="sequences per GPU per forward (default: every divisor of the batch per replica)")
    p.add_argument("--top", type=positive_int, default=10, help="how many layouts to print")
    p.add_argument("--json", help="also write the ranked predictions to this file")
    p.add_argument("--force", action="store_true", help="replace an existing --json or --plot file")
    p.add_argument("--validate", action="store_true", help="the table against the papers; exit 1 if a row is off")
    p.add_argument("--plot", help="with --validate: also draw the published and predicted scaling to this picture")
    p.add_argument("--list-hardware", action="store_true", help="the hardware profiles --hardware takes")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


@command
def main(argv=None):
    args = parse_args(argv)
    from pipeline.planning.run import run_plan  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_plan(args)


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    raise SystemExit(main())
