"""Import a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral or Qwen3-MoE causal LM (a directory or a GGUF
file) for training here.

    python -m pipeline.import_hf --model DIR_OR_GGUF --out DIR --tensor-parallel T --pipeline-parallel P
                                 [--dtype float32|bfloat16|float16] [--force]

Writes ``config.json`` (the project's GPTConfig), ``model.safetensors`` (the full
TP=1 state dict) and the tokenizer files. The full state dict loads into the model
at any tensor-parallel size (``pipeline.checkpoints.state_dicts.load_full_state_dict``); T and P
are checked against the model here so that a layout that cannot work is refused
before anything is written, with the sizes that would.
"""
from __future__ import annotations



from pipeline.job.arguments import add_dtype_arg
from pipeline.job.errors import ArgumentParser, job_command
from pipeline.job.numbers import positive_int


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="mds-import-hf", description=__doc__)
    p.add_argument("--model", required=True, help="Hugging Face model directory, or a .gguf file")
    p.add_argument("--gguf-file", help="name of the .gguf file inside --model (when it is a directory)")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1,
                   help="TP size the model will be trained at (checked)")
    p.add_argument("--pipeline-parallel", type=positive_int, default=1,
                   help="PP size the model will be trained at (checked)")
    add_dtype_arg(p, help="dtype of the saved weights (float32: the training master weights)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


def _job():
    from pipeline.hf.run import import_model  # noqa: PLC0415  (deferred: --help must not load torch)
    return import_model


main, cli = job_command(parse_args, _job, __name__)  # cli: the console script (pyproject.toml)
