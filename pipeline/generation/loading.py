"""The model to generate with, at this rank's tensor-parallel shard: a project model directory (a pretraining run
saved at any layout, one of its tags, or config.json + model.safetensors, through
``evaluation.lm_scoring.load_project_model``) or a local Hugging Face directory (converted in memory by
``hf.convert.from_hf``, one tensor at a time). Called on every rank after ``init_distributed()``."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from models.parallel import initialize_model_parallel
from pipeline.evaluation.lm_scoring.loading import DTYPES, build_filled, load_hf_tokenizer, load_project_model
from pipeline.hf.convert import from_hf, resolve_hf_source
from pipeline.job.families import family_of


def device_of_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def load_hf_as_project(hf_dir: str | Path, tensor_parallel: int, tokenizer: str | Path | None = None):
    """(project model at this rank's shard, tokenizer) of a Hugging Face causal-LM directory."""
    initialize_model_parallel(tensor_parallel, 1)
    source = resolve_hf_source(hf_dir)
    config, full = from_hf(source.directory, gguf_file=source.gguf_file, dtype=torch.float32, source=str(source))
    family = family_of(config)
    family.check_layout(config, tensor_parallel, 1)
    model = build_filled(family, config, full, str(hf_dir)).eval()
    return model, load_hf_tokenizer(tokenizer or hf_dir)


def load_generation_model(*, checkpoint=None, hf=None, tensor_parallel: int = 1, tokenizer=None,
                          dtype: str = "fp32"):
    """(model on this rank's device in ``dtype``, HFTokenizer) from ``checkpoint`` or ``hf``."""
    if checkpoint is not None:
        model, tok = load_project_model(checkpoint, tensor_parallel, tokenizer)
    else:
        model, tok = load_hf_as_project(hf, tensor_parallel, tokenizer)
    return model.to(device=device_of_rank(), dtype=DTYPES[dtype]), tok
