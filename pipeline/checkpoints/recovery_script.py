"""The run directory's ``zero_to_fp32.py``: DeepSpeed copies its own into every run at each save, and it merges
one data-parallel group's ZeRO files only (at TP 2 it fails: "Expected 1 of '*_optim_states.pt' ... but found 2
files"; a pipeline's layer files it does not read). The project's replaces it after each save: the same name and
arguments (``python RUN/zero_to_fp32.py RUN OUT [-t TAG]``), the full weights of any layout through
``read_full_checkpoint``, written as a project model directory (config.json + model.safetensors + tokenizer),
which ``pipeline.generate``, ``pipeline.evaluate`` and ``pipeline.export_hf`` read. The weights are those the run
computes with (a bf16 run's in bf16; DeepSpeed's script gave the fp32 master copies of the optimizer)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.job.errors import ArgumentParser, command, is_rank0
from pipeline.job.files import atomic_write_text

SCRIPT_NAME = "zero_to_fp32.py"
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout that wrote the run: the script reads with it
SCRIPT = '''#!/usr/bin/env python
"""The full weights of this run at any layout (TP, PP, ZeRO), written by the project that trained it over
DeepSpeed's zero_to_fp32.py (which merges one data-parallel group only):

    python zero_to_fp32.py RUN_DIR OUT_DIR [-t global_stepN]

OUT_DIR: config.json + model.safetensors + tokenizer, a project model directory; for Hugging Face,
python -m pipeline.export_hf --checkpoint RUN_DIR --out HF_DIR."""
import os
import sys

if os.path.isdir(os.path.join({root!r}, "pipeline")):
    sys.path.insert(0, {root!r})  # the checkout that wrote this run reads it (else the installed project)
try:
    from pipeline.checkpoints.recovery_script import main
except ImportError as e:
    print(f"error: {{e}}: this run was written by the pipeline project; install it (pip install -e <checkout>) and "
          f"run this script again, or python -m pipeline.export_hf --checkpoint RUN_DIR --out HF_DIR", file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[1:]))
'''


def script_text() -> str:
    """The run's zero_to_fp32.py, naming this checkout as the fallback place of the project."""
    return SCRIPT.format(root=str(PROJECT_ROOT))


def install(tag_dir: Path) -> None:
    """Replace (rank 0) the zero_to_fp32.py DeepSpeed copied beside the tag ``checkpoint.save`` wrote by the
    project's, executable."""
    if not is_rank0():
        return
    script, text = Path(tag_dir).parent / SCRIPT_NAME, script_text()
    if script.is_file() and script.read_text() == text:
        return
    atomic_write_text(script, text)
    os.chmod(script, script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


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
