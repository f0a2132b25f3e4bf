"""Training curves of one or several runs from their metrics.jsonl, overlaid (to compare layouts or recipes).

    python -m pipeline.plot runs/a runs/b [--label A --label B] --out curves.png

Panels against the optimizer step: training loss (solid) with validation loss (dashed, circles), learning
rate, and tokens/s, plus MFU when a run logged it and, for a mixture of experts, each MoE layer's max/mean
expert load and dropped fraction and the auxiliary loss. A RUN is a run directory or its metrics.jsonl.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.files import check_output_file, refuse_overlap
from pipeline.job.numbers import int_in
from pipeline.tracking.plot import plot_runs


def parse_args(argv=None):
    parser = ArgumentParser(prog="mds-plot", description=__doc__)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or their metrics.jsonl)")
    parser.add_argument("--out", required=True, help="the picture to write (.png, .svg, .pdf)")
    parser.add_argument("--label", action="append", help="a legend name per run (default: the run's folder name)")
    parser.add_argument("--dpi", type=int_in(1, 2400), default=80, help="resolution of a .png (dots per inch)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    return parser.parse_args(argv)


@command
def main(argv=None) -> Path:
    args = parse_args(argv)
    refuse_overlap(args.out, [("RUN", run) for run in args.runs])
    check_output_file(args.out, args.force)
    out = plot_runs(args.runs, args.out, args.label, args.dpi)
    print(f"wrote {out}")
    return out


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
