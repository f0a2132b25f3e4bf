"""The arguments every training command shares (engine layout, batch sizes, run settings) and the
``EngineOptions`` they become.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.engine.ds_auto import AutoValues
from pipeline.job.numbers import non_negative_int, positive_float, positive_int


DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def default_ds_config() -> str:
    return str(DS_CONFIGS / ("bf16_zero1.json" if torch.cuda.is_available() else "cpu.json"))


# -- argument groups ---------------------------------------------------------------------------------------------------

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
    g.add_argument("--seed", type=non_negative_int, default=1234)
    g.add_argument("--log-interval", type=positive_int, default=log_interval)
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


# -- setup -------------------------------------------------------------------------------------------------------------

@dataclass
class EngineOptions:
    """What travels from the command line to the engine (``add_engine_args`` + ``add_run_args``)."""
    deepspeed_config: str | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    tiled_mlp: int = 1
    tiled_loss: int = 1
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    seed: int = 1234
    verbose: bool = False
    save: str | None = None  # the run directory: DeepSpeed's monitor writes inside it
    exit_signal_handler: bool = True  # add_fault_args
    max_bad_steps: int = 1
    distributed_timeout_minutes: float | None = None
    recompute: str = "none"  # the model group's (job.model_configs.add_model_args)
    recompute_modules: tuple[str, ...] = ()
    compile: bool = False
    fp8: str | None = None
    loss_chunk_tokens: int | None = None
    lr: float | None = None  # the optimization group's (engine.schedules.add_lr_args): what fills an "auto"
    lr_warmup_steps: int | None = None
    train_steps: int | None = None

    def auto_values(self, model_config=None) -> AutoValues:
        """What fills a Hugging Face-style "auto" in the DeepSpeed config (``engine.ds_auto``)."""
        return AutoValues(lr=self.lr, warmup_steps=self.lr_warmup_steps, total_steps=self.train_steps,
                          hidden_size=getattr(model_config, "hidden_size", None))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineOptions:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})


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
