"""Import a Hugging Face GPT-2, Llama, Qwen2, Qwen3 or Mistral causal LM (a directory or a GGUF file) for training here.

    python -m pipeline.import_hf --model DIR_OR_GGUF --out DIR --tensor-parallel T --pipeline-parallel P
                                 [--dtype float32|bfloat16|float16] [--force]

Writes ``config.json`` (the project's GPTConfig), ``model.safetensors`` (the full
TP=1 state dict) and the tokenizer files. The full state dict loads into the model
at any tensor-parallel size (``pipeline.state_dicts.load_full_state_dict``); T and P
are checked against the model here so that a layout that cannot work is refused
before anything is written, with the sizes that would.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from models.config import ConfigError, GPTConfig
from pipeline.errors import ArgumentParser, add_debug_arg, command
from pipeline.files import check_output_dir, refuse_overlap
from pipeline.hf_convert import (
    ConversionError,
    add_dtype_arg,
    config_from_hf,
    from_hf,
    load_hf_config,
    num_parameters_message,
    parallel_sizes,
    parse_dtype,
    resolve_hf_source,
)
from pipeline.model_dir import has_tokenizer, write_model_dir


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


@command
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m pipeline.import_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory, or a .gguf file")
    p.add_argument("--gguf-file", help="name of the .gguf file inside --model (when it is a directory)")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="TP size the model will be trained at (checked)")
    p.add_argument("--pipeline-parallel", type=int, default=1, help="PP size the model will be trained at (checked)")
    add_dtype_arg(p, help="dtype of the saved weights (float32: the training master weights)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_debug_arg(p)
    args = p.parse_args(argv)
    config, out = import_hf(args.model, args.out, tensor_parallel=args.tensor_parallel,
                            pipeline_parallel=args.pipeline_parallel, dtype=args.dtype,
                            gguf_file=args.gguf_file, force=args.force)
    print(f"imported {config.hf_model_type} model ({num_parameters_message(config)}, {config.num_layers} layers, "
          f"{config.num_heads} heads / {config.num_kv_heads} KV heads) to {out}; "
          f"fits --tensor-parallel {args.tensor_parallel} --pipeline-parallel {args.pipeline_parallel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
