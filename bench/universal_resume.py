"""Resume at another layout: step 3-4 losses with the optimizer state carried (universal checkpoints) vs
restarted (weights only, the behaviour before them), against the uninterrupted run.

    python bench/universal_resume.py [--work DIR]

The transitions, model and configs are those of tests/test_universal.py (fp32, dropout 0, a tiny GPT,
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


def _pretrain_restarted(rank, argv, fp16):
    import pipeline.universal
    pipeline.universal.unsupported_reason = lambda saved, current: "the optimizer state is restarted (baseline)"
    return tu._pretrain(rank, argv, fp16)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        import inspect
        import json
        (work / "corpus.txt").write_text(inspect.getsource(json) + "\n\n" + inspect.getsource(inspect))
        (work / "model.json").write_text(json.dumps(tu.MODEL))
        print(f"{'transition':<20} {'carried step 3':>15} {'step 4':>10} {'restarted step 3':>17} {'step 4':>10}")
        for source, target in tu.TRANSITIONS:
            ref = tu.losses(tu.reference(work, source))
            row = []
            for name, worker in (("carried", None), ("restarted", _pretrain_restarted)):
                out = tu.run(work, target, work / f"{name}_{source}_{target}", "--load", str(work / f"ref_{source}"),
                             "--load-tag", "global_step2", worker=worker)
                got = tu.losses(out)
                row += [abs(got[s] - ref[s]) / ref[s] for s in (3, 4)]
            print(f"{source + ' -> ' + target:<20} {row[0]:>15.2e} {row[1]:>10.2e} {row[2]:>17.2e} {row[3]:>10.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
