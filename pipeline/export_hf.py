"""Export a trained model to a Hugging Face directory that ``from_pretrained`` loads without custom code.

    python -m pipeline.export_hf --checkpoint DIR --out DIR [--dtype float32|float16|bfloat16]
                                 [--tokenizer DIR] [--force] [--verify]

The output holds safetensors weights, ``config.json``, ``generation_config.json`` and
the tokenizer files. It is written into a temporary directory beside ``--out`` and
renamed into place when complete. ``--verify`` reloads the export with transformers
and compares its logits with the project model's.

Each model family exports through one small function that its entry in ``pipeline.job.families`` names
(config + full state dict -> ``HFExport``) and verifies through another (the project model's logits);
the directory writing, tokenizer and verification are shared.
"""
from __future__ import annotations

import sys


from models.config import GPTConfig
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.hf.convert import add_dtype_arg, dtype_name, hf_family, num_parameters_message, parse_dtype
from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.job.files import check_output_dir, refuse_overlap
from pipeline.hf.export import compare_with_hf, export_hf


# -- command line ------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="python -m pipeline.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory to export")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    add_dtype_arg(p, help="dtype of the exported weights")
    p.add_argument("--tokenizer", help="directory of Hugging Face tokenizer files (default: the checkpoint's own)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verify", action="store_true",
                   help="reload the export with transformers and compare its logits with the project model's")
    return p.parse_args(argv)


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    sys.exit(main())
