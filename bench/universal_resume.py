"""Resume at another layout: step 3-4 losses with the optimizer state carried (universal checkpoints) vs
restarted (weights only, the behaviour before them), against the uninterrupted run.

    python bench/universal_resume.py [--work DIR]

The transitions, model and configs are those of tests/pipeline/checkpoints/test_universal.py (fp32, dropout 0, a tiny GPT,
4 steps; resumed from step 2). Prints one line per transition: relative loss differences at steps 3 and 4.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_universal as tu  # the tests' runs, so that the two measure the same thing

import pipeline.checkpoints.universal


def _pretrain_restarted(rank, argv, fp16):
    pipeline.checkpoints.universal.unsupported_reason = lambda saved, current: "the optimizer state is restarted (baseline)"
    return tu._pretrain(rank, argv, fp16)


def _run_once(work: Path, name: str, make) -> dict:
    """The losses of the run ``work/name``, made now unless an earlier invocation left it complete."""
    out = work / name
    if not (out / "metrics.jsonl").is_file() or 4 not in tu.losses(out):
        make(out)
    return tu.losses(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="directory for the runs, reused when given again (default: a "
                                                "temporary one); pytest's directory of tests/pipeline/checkpoints/test_universal.py "
                                                "(ref_*, resumed_*) works too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        import inspect
        import json
        if not (work / "corpus.txt").is_file():
            (work / "corpus.txt").write_text(inspect.getsource(json) + "\n\n" + inspect.getsource(inspect))
        (work / "model.json").write_text(json.dumps(tu.MODEL))
        print(f"{'transition':<20} {'carried step 3':>15} {'step 4':>10} {'restarted step 3':>17} {'step 4':>10}")
        for source, target in tu.TRANSITIONS:
            ref = _run_once(work, f"ref_{source}", lambda out: tu.run(work, source, out, "--save-interval", "2"))
            row = []
            for name, worker in ((f"resumed_{source}_{target}", None),
                                 (f"restarted_{source}_{target}", _pretrain_restarted)):
                got = _run_once(work, name, lambda out: tu.run(work, target, out, "--load", str(work / f"ref_{source}"),
                                                               "--load-tag", "global_step2", worker=worker))
                row += [abs(got[s] - ref[s]) / ref[s] for s in (3, 4)]
            print(f"{source + ' -> ' + target:<20} {row[0]:>15.2e} {row[1]:>10.2e} {row[2]:>17.2e} {row[3]:>10.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
