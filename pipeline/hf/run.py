"""What ``pipeline.export_hf`` and ``pipeline.import_hf`` do with their parsed arguments (the commands parse them
without loading torch)."""
from __future__ import annotations

import sys

from models.config import GPTConfig
from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.hf.convert import dtype_name, hf_family, num_parameters_message, parse_dtype
from pipeline.hf.export import compare_with_hf, export_hf
from pipeline.hf.importer import import_hf
from pipeline.job.files import check_output_dir, refuse_overlap

__all__ = ["export_checkpoint", "import_model"]


def export_checkpoint(args) -> int:
    """``pipeline.export_hf``: the checkpoint as a Hugging Face directory; 1 when ``--verify`` finds it off."""
    refuse_overlap(args.out, [("--checkpoint", args.checkpoint), ("--tokenizer", args.tokenizer)])
    check_output_dir(args.out, args.force)  # before reading the checkpoint
    config, full_sd, tokenizer_dir = read_full_checkpoint(args.checkpoint, lazy=True)
    tokenizer_dir = args.tokenizer or tokenizer_dir
    out = export_hf(config, full_sd, args.out, dtype=args.dtype, tokenizer_dir=tokenizer_dir, force=args.force)
    arch = hf_family(config).architecture if isinstance(config, GPTConfig) else type(config).__name__
    print(f"exported {arch} ({num_parameters_message(config)}, {dtype_name(parse_dtype(args.dtype))}) to {out}"
          + ("" if tokenizer_dir else " (no tokenizer: pass --tokenizer DIR to include one)"))
    if args.verify:
        diff = compare_with_hf(config, full_sd, out)
        print(f"verify: max relative logit difference {diff:.2e}")
        if diff > 1e-4:
            print("verify: FAILED (more than 1e-4)", file=sys.stderr)
            return 1
    return 0


def import_model(args) -> int:
    """``pipeline.import_hf``: a Hugging Face model (directory or GGUF) as a project model directory."""
    config, out = import_hf(args.model, args.out, tensor_parallel=args.tensor_parallel,
                            pipeline_parallel=args.pipeline_parallel, dtype=args.dtype,
                            gguf_file=args.gguf_file, force=args.force)
    print(f"imported {config.hf_model_type} model ({num_parameters_message(config)}, {config.num_layers} layers, "
          f"{config.num_heads} heads / {config.num_kv_heads} KV heads) to {out}; "
          f"fits --tensor-parallel {args.tensor_parallel} --pipeline-parallel {args.pipeline_parallel}")
    return 0
