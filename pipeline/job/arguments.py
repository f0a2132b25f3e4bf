"""The argument groups of the commands, in a module that imports neither torch nor DeepSpeed: building any command's
parser, and so ``--help``, loads no heavy library (tests/test_cli_parsers.py asserts it). What reads the flags stays
beside what it configures (``options.EngineOptions``, ``engine.schedules.schedule_from_args``,
``checkpoints.async_save.make_saver``, ...); those modules load torch.

The few values a flag shows that the model layer defines (``--recompute-modules``, ``--fp8``) are repeated here,
because importing ``models`` loads torch and DeepSpeed; tests/test_cli_parsers.py checks them against the originals.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.job.errors import UserError
from pipeline.job.numbers import (float_in, int_in, non_negative_int, positive_float, positive_int, probability)

# the package's own files, found beside it (package data in a wheel)
PRESETS = Path(__file__).resolve().parents[2] / "models" / "configs"
RECOMPUTE_POLICIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp_act", "mlp", "moe_act", "layernorm")  # models.gpt's
FP8_RECIPES = ("tensorwise", "rowwise")  # models.parallel.layout's: torchao's float8 training recipes
DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
STRAGGLER_THRESHOLD = 1.5
EVALUATION_TASKS = ("wikitext", "lambada", "bpc")  # pipeline.evaluate --task
MEGATRON_STRIDE = 32  # Megatron-LM's --overlapping-eval default: pipeline.evaluate's --stride


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


# -- the training job: engine, run, faults, checkpoints ----------------------------------------------------------------

def add_engine_args(parser: argparse.ArgumentParser, *, pipeline_parallel: bool = True):
    g = parser.add_argument_group("parallelism and engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="DeepSpeed JSON config (default: ds_configs/cpu.json without a GPU, bf16_zero1.json with)")
    g.add_argument("--tensor-parallel", type=positive_int, default=1,
                   help="tensor parallelism (Megatron-LM): heads, MLP columns and the vocabulary split over this many "
                        "ranks (default 1)")
    if pipeline_parallel:
        g.add_argument("--pipeline-parallel", type=positive_int, default=1,
                       help="pipeline stages of layers (DeepSpeed's pipeline engine; default 1)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism (Korthikanti et al. 2022): norms, dropout and residuals on 1/TP of "
                        "the sequence per tensor-parallel rank; needs --tensor-parallel > 1 and a sequence length "
                        "divisible by it")
    g.add_argument("--context-parallel", type=positive_int, default=1,
                   help="context parallelism (DeepSpeed-Ulysses): each sequence split into C chunks across C ranks, "
                        "attention heads exchanged by all-to-all; world = TP x CP x PP x DP; needs a sequence length "
                        "divisible by C (x TP with --sequence-parallel) and heads per TP rank divisible by C "
                        "(docs/long_context.md)")
    g.add_argument("--expert-parallel", type=positive_int, default=1, metavar="E",
                   help="mixture of experts: each MoE layer's experts split over E ranks of the data-parallel group "
                        "(E divides DP and num_experts; DeepSpeed-MoE's all-to-all; docs/moe.md)")
    g.add_argument("--tiled-mlp", type=positive_int, default=1, metavar="N",
                   help="ALST: each MLP runs on N tiles of the sequence (DeepSpeed's TiledMLP), so its [s, ffn/TP] "
                        "activations are never held whole; recomputes the MLP forward once more (default 1: off)")
    g.add_argument("--tiled-loss", type=positive_int, default=1, metavar="N",
                   help="ALST: the output layer and the loss run on N tiles of the sequence (DeepSpeed's "
                        "sequence_tiled_compute), so the [s, V/TP] logits are never held whole (default 1: off)")
    g.add_argument("--micro-batch-size", type=positive_int, help="overrides train_micro_batch_size_per_gpu")
    g.add_argument("--global-batch-size", type=positive_int, help="overrides train_batch_size")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return g


def add_run_args(parser: argparse.ArgumentParser, group=None, *, log_interval: int = 1):
    g = group or parser.add_argument_group("run")
    g.add_argument("--seed", type=non_negative_int, default=1234,
                   help="seed of the weights' initialisation, dropout and the data order")
    g.add_argument("--log-interval", type=positive_int, default=log_interval,
                   help="steps between metric records (metrics.jsonl, the progress bar, the monitor)")
    g.add_argument("--verbose", action="store_true", help="DeepSpeed's INFO logs")
    add_fault_args(g)
    return g


def add_fault_args(g) -> None:
    """What the job does on a stop signal, a non-finite loss, a dead or stuck rank (docs/faults.md)."""
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
                   help="on SIGTERM or SIGUSR1 to any rank: finish the step, save a checkpoint (with --save), "
                        "exit 0 (default: on)")
    g.add_argument("--max-bad-steps", type=non_negative_int, default=1,
                   help="stop after this many steps with a NaN/Inf loss, none of them saved (bf16/fp32; fp16 "
                        "skips them by loss scaling); 0: never stop")
    g.add_argument("--distributed-timeout-minutes", type=positive_float, default=10.0,
                   help="how long a collective waits for a dead or stuck rank before the job fails (default 10)")


def add_checkpoint_args(p):
    """--save, --load and the intervals of a pretraining job; returns the group (add_run_args adds to it)."""
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None,
                   help="the run directory: checkpoints, metrics.jsonl, args.json, ds_config.json (docs/runs.md)")
    g.add_argument("--save-interval", type=positive_int, default=None,
                   help="steps between checkpoints (default: at the end)")
    g.add_argument("--load", default=None,
                   help="resume from this run directory's latest complete checkpoint (any TP/PP/DP layout), or "
                        "start from the weights of a config.json + model.safetensors directory (pipeline.import_hf)")
    g.add_argument("--load-tag", default=None, help="resume from this tag (e.g. global_step200) instead of latest")
    g.add_argument("--no-resume", action="store_true",
                   help="start a new run: refused when --save already holds files (choose a new directory). Without "
                        "it, a --save holding a complete checkpoint resumes that run (no --load needed)")
    g.add_argument("--eval-interval", type=positive_int, default=None, help="steps between validations (default: none)")
    g.add_argument("--eval-iters", type=positive_int, default=2, help="validation batches per validation (default 2)")
    g.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="per-device peak TFLOP/s for MFU (no MFU without it; 989 for H100/H200 dense bf16)")
    return g


def add_async_save_args(group):
    """--async-save, in the checkpoint arguments' group (returned, for the groups that add to it)."""
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background: the step's state is copied to host memory and "
                            "training goes on while it is written (latest moves once it is complete; "
                            "docs/checkpoints.md)")
    return group


# -- the pretraining job's model, data, samples and stragglers -----------------------------------------------------

def recompute_modules_arg(text: str) -> tuple[str, ...]:
    """argparse type of ``--recompute-modules``: a comma list of ``RECOMPUTE_MODULES``, each once (returned in
    that order)."""
    names = tuple(n.strip() for n in text.split(","))
    bad = [n for n in names if n not in RECOMPUTE_MODULES]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'repeated'}"
                                         f" module; give a comma list of {', '.join(RECOMPUTE_MODULES)}")
    if {"mlp", "mlp_act"} <= set(names):
        raise argparse.ArgumentTypeError(f"{text!r}: mlp recomputes the whole MLP, mlp_act included; name one of them")
    return tuple(n for n in RECOMPUTE_MODULES if n in names)


def check_recompute_args(args):
    """``args`` with ``recompute_modules`` resolved (default core_attn); ``--recompute-modules`` is refused without
    ``--recompute selective``, the only policy it shapes."""
    if args.recompute_modules is not None and args.recompute != "selective":
        raise UserError(f"--recompute-modules: applies to --recompute selective, not {args.recompute}; "
                        f"add --recompute selective or drop --recompute-modules")
    args.recompute_modules = args.recompute_modules or ("core_attn",)
    return args


def add_model_args(p) -> None:
    """The model arguments of the pretraining job (its "model" group)."""
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=["gpt", "mlstm"], default=None,
                   help="gpt (default) or mlstm (the character-level multiplicative LSTM, trained by truncated "
                        "BPTT on contiguous byte streams; default: the model config's model_type)")
    g.add_argument("--model-config", default=None,
                   help=f"a JSON file, or a preset name from models/{PRESETS.name}/ ({', '.join(presets())}); default: "
                        f"the checkpoint's config with --load, else gpt2-tiny")
    g.add_argument("--seq-length", type=int, help="training sequence length (default: the config's seq_length)")
    g.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default="none",
                   help="activation recomputation: selective recomputes each layer's --recompute-modules, full every "
                        "layer (docs/performance.md has the measured memory)")
    g.add_argument("--recompute-modules", type=recompute_modules_arg, default=None,
                   help=f"what --recompute selective recomputes, a comma list of {', '.join(RECOMPUTE_MODULES)} "
                        f"(Megatron-Core's names; mlp_act: the dense MLP's GELU / SwiGLU; mlp: the whole dense MLP; "
                        f"moe_act: the experts' activation; layernorm: both norms, LayerNorm or RMSNorm; default "
                        f"core_attn)")
    g.add_argument("--activation-checkpointing", dest="recompute", action="store_const", const="full",
                   help="the same as --recompute full")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (models/compile.py: no graph break at TP 1-2, with "
                        "or without SP, CP 2, on pipeline stages, with or without dropout; an MoE block's routed "
                        "experts and a tiled MLP's tiles run eagerly between its two graphs); ZeRO 0-2; "
                        "bench/train_step.py --systems deepspeed,deepspeed+compile measures what it gains")
    g.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                   help="the column- and row-parallel linears' products in FP8 with torchao's float8 recipe "
                        "(models/parallel/fp8.py): the weights, checkpoints and exports stay in the run's precision, "
                        "so an FP8 run resumes without it and back; dense GPT models; where the device has no FP8 "
                        "matmuls (a CPU, a GPU before compute capability 8.9) torchao's emulation, FP8's numerics "
                        "at fp32's speed (docs/performance.md)")
    g.add_argument("--loss-chunk-tokens", type=positive_int, default=None, metavar="N",
                   help="the cross-entropy N tokens at a time: its fp32 work tensors are [N, V/TP], never [tokens, "
                        "V/TP], and a bf16 run keeps its bf16 logits for the backward instead of an fp32 softmax "
                        "(half the loss's memory); the same loss bit for bit, slower on a CPU (bench/chunked_loss.py)")


def add_data_args(p) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", default=None,
                   help="a corpus: files, folders, globs, save_to_disk dirs, hub names; repeat or comma-separate "
                        "to concatenate (default: the Python standard library's source, real text on every machine)")
    g.add_argument("--data-weights", help="comma-separated mixture weights, one per --data source")
    g.add_argument("--data-encoding-errors", choices=["strict", "replace", "ignore"], default="strict",
                   help="bytes that are not UTF-8: refuse the file (strict, default), or read them as U+FFFD "
                        "(replace) or drop them (ignore)")
    g.add_argument("--text-field", default="text",
                   help="the field holding the text in JSON(L), CSV or datasets sources")
    g.add_argument("--streaming", action="store_true",
                   help="read the corpus as it is tokenized (datasets' streaming mode) instead of all of it first")
    g.add_argument("--tokenizer", default=None,
                   help="'bytes', 'train-bpe', a tokenizer.json, or a directory with vocab.json + merges.txt "
                        "(default: the checkpoint's when resuming, else train-bpe)")
    g.add_argument("--vocab-size", type=int_in(1, 2**24), default=4096, help="vocabulary of --tokenizer train-bpe")
    g.add_argument("--valid-fraction", type=probability(open_high=True), default=0.01,
                   help="fraction of the corpus held out for validation")
    g.add_argument("--num-proc", type=int_in(1, 1024), default=1, help="processes for tokenization")
    g.add_argument("--cache-dir", default=None, help="datasets cache directory")


def add_sample_args(p) -> None:
    g = p.add_argument_group("samples during training")
    g.add_argument("--sample-interval", type=positive_int,
                   help="every N steps (and at the last), continue --sample-prompts greedily and sampled; written to "
                        "samples.jsonl in the run and to DeepSpeed's monitor (rank 0)")
    g.add_argument("--sample-prompts", type=Path, help="prompts file: one a line, or .jsonl {\"prompt\": ...}")
    g.add_argument("--sample-new-tokens", type=positive_int, default=32, help="tokens per sample (default 32)")
    g.add_argument("--sample-temperature", type=positive_float, default=1.0, help="temperature of the sampled one")
    g.add_argument("--sample-top-k", type=positive_int, help="top-k of the sampled one (default: the whole vocabulary)")


def add_straggler_args(parser) -> None:
    g = parser.add_argument_group("straggler detection")
    g.add_argument("--straggler-interval", type=positive_int, default=None, metavar="N",
                   help="every N steps, name the rank with the most compute time over those steps and its ratio to "
                        "the median (metrics.jsonl, the monitor; default: off)")
    g.add_argument("--straggler-threshold", type=float_in(1), default=STRAGGLER_THRESHOLD, metavar="RATIO",
                   help=f"print a warning when the slowest rank's ratio to the median is above this "
                        f"(default {STRAGGLER_THRESHOLD})")


# -- models read and written, text generated ---------------------------------------------------------------------------

def add_dtype_arg(parser, *, default: str = "float32", help: str = "dtype of the weights") -> None:
    """``--dtype``, the same names for every command: float32/bfloat16/float16 or fp32/bf16/fp16."""
    parser.add_argument("--dtype", default=default, choices=DTYPE_CHOICES, help=f"{help} (default {default})")


def add_sampling_args(p, *, max_new_tokens: int = 64) -> None:
    """--max-new-tokens, --greedy, --temperature, --top-k, --top-p, --seed (generation and pretraining samples)."""
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help=f"tokens to add to each prompt at most (default: {max_new_tokens})")
    p.add_argument("--greedy", action="store_true", help="the most likely token at every step (no sampling)")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--top-k", type=positive_int, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=probability(open_low=True),
                   help="sample among the most likely tokens holding this probability")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the sampling (default: 0; the same at any TP)")


