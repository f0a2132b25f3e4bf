"""Convert a checkpoint once, offline, into a run directory that resumes at any layout with its optimizer state.

    python -m pipeline.reshard --checkpoint runs/gpt2 --out runs/gpt2-universal [--tag global_step200]
    deepspeed --num_gpus 8 pipeline/pretrain.py --load runs/gpt2-universal --tensor-parallel 4 ...

``--load RUN`` into another layout converts on its own (into ``RUN/universal/<tag>``, reused by later
loads); this is for clusters where the conversion should run once, before the job, on one machine.
The output holds the run's config and tokenizer, the universal checkpoint
(``universal/<tag>``, DeepSpeed's format) and a tag directory with the saved layout, data position
and RNG streams, marked as universal only; the source is not written to.
"""
from __future__ import annotations

import sys

from pipeline.job.errors import ArgumentParser, command, console_script


def parse_args(argv=None):
    p = ArgumentParser(prog="mds-reshard", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a pretraining run directory")
    p.add_argument("--out", required=True, help="the new run directory (must not exist or be empty)")
    p.add_argument("--tag", default=None, help="the tag to convert (default: the run's latest)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.checkpoints.reshard import reshard  # noqa: PLC0415  (deferred: --help must not load torch)
    out = reshard(args.checkpoint, args.out, args.tag, force=args.force)
    print(f"wrote {out}: resume it at any layout with --load {out}")
    return 0


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    sys.exit(main())
