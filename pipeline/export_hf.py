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


from pipeline.job.arguments import add_dtype_arg
from pipeline.job.errors import ArgumentParser, job_command


# -- command line ------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="mds-export-hf", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory to export")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    add_dtype_arg(p, help="dtype of the exported weights")
    p.add_argument("--tokenizer", help="directory of Hugging Face tokenizer files (default: the checkpoint's own)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verify", action="store_true",
                   help="reload the export with transformers and compare its logits with the project model's")
    return p.parse_args(argv)


def _job():
    from pipeline.hf.run import export_checkpoint  # noqa: PLC0415  (deferred: --help must not load torch)
    return export_checkpoint


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
