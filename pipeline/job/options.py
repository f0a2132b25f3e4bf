"""What the arguments every training command shares (engine layout, batch sizes, run settings) become:
``EngineOptions``, and the DeepSpeed config a run without ``--deepspeed_config`` uses. The argument groups
themselves are in ``pipeline.job.arguments`` (no torch: a parser builds without it) and re-exported here.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.engine.ds_auto import AutoValues
from pipeline.job.arguments import (add_checkpoint_args, add_engine_args, add_fault_args,  # noqa: F401 (re-exported)
                                    add_run_args)


DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def default_ds_config() -> str:
    return str(DS_CONFIGS / ("bf16_zero1.json" if torch.cuda.is_available() else "cpu.json"))


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
    recompute: str = "none"  # the model group's (job.arguments.add_model_args)
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
