"""Shared pieces of the tests that launch the pretraining job: a tiny GPT-2, a real-text corpus, DeepSpeed
configs, and the worker that runs ``pipeline.pretrain.main`` on each rank of ``dist.run_distributed``."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

from deepspeed.accelerator import get_accelerator

from pipeline.pretrain import main as pretrain_main

TINY_GPT2 = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
             "hidden_dropout": 0.1, "attention_dropout": 0.1, "make_vocab_size_divisible_by": 8}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}


def ds_config(stage: int = 1, fp16: bool = False, train_batch_size: int = 4, lr: float = 3e-3) -> dict:
    """fp32 (or fp16 with a small initial scale) AdamW with clipping, at ZeRO ``stage``: the DeepSpeed config
    of the tests that launch the pretraining job."""
    optimizer = {**OPTIMIZER, "params": {**OPTIMIZER["params"], "lr": lr}}
    ds = {"train_batch_size": train_batch_size, "optimizer": optimizer, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if fp16:
        ds["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return ds


def source_text(*modules) -> str:
    """Real text for a byte-level model: the source of the given modules (default json and inspect)."""
    return "\n\n".join(inspect.getsource(m) for m in (modules or (json, inspect)))


def write_corpus(directory: Path, *modules, name: str = "corpus.txt") -> Path:
    path = Path(directory) / name
    path.write_text(source_text(*modules))
    return path


def pretrain_worker(rank, argv, fp16: bool = False):
    """``pipeline.pretrain.main(argv)`` on one rank; ``fp16``: DeepSpeed's CPU accelerator is told it can."""
    if fp16:
        get_accelerator().is_fp16_supported = lambda: True
    pretrain_main(argv)
    return 0


def write_job_files(directory: Path, model: dict, corpus: str, ds: dict | None = None) -> Path:
    """corpus.txt, model.json and ds.json (default ``ds_config(stage=1)``) of a tiny CLI job in ``directory``."""
    directory = Path(directory)
    (directory / "corpus.txt").write_text(corpus)
    (directory / "model.json").write_text(json.dumps(model))
    (directory / "ds.json").write_text(json.dumps(ds or ds_config(stage=1)))
    return directory
