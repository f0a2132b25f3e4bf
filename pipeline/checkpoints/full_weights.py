"""The command behind a run's ``zero_to_fp32.py`` (``pipeline.checkpoints.recovery_script``): the full weights
of a run at any layout (``read_full_checkpoint``), written as a project model directory."""
from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.checkpoints.recovery_script import SCRIPT
from pipeline.job.errors import ArgumentParser, command


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="zero_to_fp32.py", description=SCRIPT.split('"""')[1])
    p.add_argument("checkpoint_dir", type=Path, help="the run directory (or one of its global_step tags)")
    p.add_argument("output_dir", type=Path, help="the model directory to write (absent or empty)")
    p.add_argument("-t", "--tag", help="the checkpoint tag (default: the run's latest)")
    # DeepSpeed's script's flags, accepted so its command lines work: the output is one safetensors file
    p.add_argument("--safe_serialization", action="store_true", help="accepted (the weights are safetensors)")
    p.add_argument("--max_shard_size", help="accepted (the weights are one file)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="accepted (a run has none)")
    return p


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    config, state_dict, tokenizer = read_full_checkpoint(args.checkpoint_dir, args.tag)
    write_model_dir(config, state_dict, args.output_dir, tokenizer=tokenizer)
    print(f"wrote the full weights of {args.checkpoint_dir}{f' ({args.tag})' if args.tag else ''} to {args.output_dir} "
          f"(config.json + model.safetensors); Hugging Face: python -m pipeline.export_hf --checkpoint "
          f"{args.checkpoint_dir} --out HF_DIR")
    return 0
