"""A Hugging Face causal LM (a directory or a GGUF file) as a project model directory
(``python -m pipeline.import_hf``): ``config.json`` (the project's GPTConfig), ``model.safetensors`` (the full
TP=1 state dict, which loads at any tensor-parallel size) and the tokenizer files. The layout is checked against
the model first, so that one that cannot work is refused before anything is written.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from models.config import ConfigError, GPTConfig
from pipeline.job.files import check_output_dir, refuse_overlap
from pipeline.hf.convert import (ConversionError, config_from_hf, from_hf, load_hf_config, parallel_sizes, parse_dtype,
                                 resolve_hf_source)
from pipeline.checkpoints import safe_load
from pipeline.checkpoints.model_dir import has_tokenizer, write_model_dir


def check_layout(config: GPTConfig, tensor_parallel: int, pipeline_parallel: int, source: str) -> None:
    """Refuse a (TP, PP) layout the model cannot be split into, naming the sizes that can."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ConversionError(f"--tensor-parallel ({tensor_parallel}) and --pipeline-parallel "
                              f"({pipeline_parallel}) must be at least 1")
    try:
        config.check_parallel(tensor_parallel, pipeline_parallel)
    except ConfigError as e:
        sizes = ", ".join(map(str, parallel_sizes(config)))
        raise ConversionError(f"{source} ({config.num_heads} heads, {config.num_kv_heads} KV heads, "
                              f"{config.num_layers} layers) cannot be split as --tensor-parallel {tensor_parallel} "
                              f"--pipeline-parallel {pipeline_parallel}: {e}. Tensor-parallel sizes that divide "
                              f"this model: {sizes}; pipeline-parallel sizes: 1 to {config.num_layers}") from None


def import_hf(model: str | Path, out: str | Path, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              dtype: str | torch.dtype = torch.float32, gguf_file: str | None = None,
              force: bool = False) -> tuple[GPTConfig, Path]:
    """Convert a Hugging Face model directory or GGUF file into the project's model directory ``out``."""
    refuse_overlap(out, [("--model", model)])
    source = resolve_hf_source(model, gguf_file)
    safe_load.scan_weight_files(source.directory)
    config = config_from_hf(load_hf_config(source), str(source))
    check_layout(config, tensor_parallel, pipeline_parallel, str(source))
    check_output_dir(out, force)  # before spending minutes on the weights
    # read and written one tensor at a time: the model is never in memory twice
    config, full_sd = from_hf(source.directory, gguf_file=source.gguf_file, dtype=parse_dtype(dtype),
                              source=str(source), lazy=True)
    if source.gguf_file:  # the tokenizer is inside the GGUF file: transformers rebuilds it
        tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    else:
        tokenizer = source.directory if has_tokenizer(source.directory) else None
    return config, write_model_dir(config, full_sd, out, tokenizer=tokenizer, force=force)
