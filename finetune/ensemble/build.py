"""Train or gather an ensemble's members, tune its thresholds on their common held-out tweets, score it, save it.

    python -m finetune.ensemble --save runs/ec-ensemble --base runs/smollm2-135m \\
        --train E-c-train.tsv --dev E-c-dev.tsv \\
        --recipe labels:1234 --recipe labels:7 --recipe last:1234 --tfidf          # finetune.recipes.EC_ENSEMBLE
    python -m finetune.ensemble --save runs/ec-mix --member runs/ec-a --member runs/ec-b --tfidf   # gathered

``--recipe NAME:SEED`` trains a member with ``finetune/train.py``, recipe NAME (``finetune.recipes.RECIPES``)
and ``--seed SEED``, in this process (the deepspeed launcher's ranks train it together), into
``SAVE/members/NAME-SEED``; a member already complete there is reused, so the rerun of an interrupted command
trains only what is missing. Arguments after ``--`` go to every trained member (``-- --deepspeed_config
ds_configs/bf16_zero1.json``). ``--member DIR`` adds a classifier or TF-IDF model trained elsewhere. ``--tfidf``
fits the TF-IDF model (``finetune.ensemble.tfidf``) on the members' training part, into ``SAVE/members/tfidf``.

Every member must hold out the same tweets of the same training file (the same ``--holdout`` and
``--holdout-seed``; the recipes' defaults agree), and none may have tuned on dev. The ensemble's probabilities
are the mean of its members'; its per-class thresholds are tuned on the held-out tweets
(``--threshold-objective``, ``--threshold-bagging``: the recipes'), never on dev. Writes ``thresholds.json``,
``eval.json`` (the ensemble's and each member's dev scores, members tuned the same way), ``dev_predictions.txt``
(and ``test_predictions.txt`` with ``--test``), ``per_class_f1.png`` and, last, ``ensemble.json``.
``finetune.predict --model SAVE`` serves it. The ensemble has no ``transformers`` export: a member trained
with the last-token recipe has its own (``SAVE/members/last-SEED/hf``).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun: the project root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from finetune.recipes import DEFAULT_HOLDOUT, DEFAULT_HOLDOUT_SEED, RECIPES
from pipeline.job.arguments import add_dtype_arg
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.numbers import non_negative_int, positive_int, probability


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = ArgumentParser(prog="mds-ensemble", description=__doc__)
    p.add_argument("--save", required=True, help="ensemble directory to write (new, or one this command wrote)")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME:SEED",
                   help=f"train a member: recipe NAME ({', '.join(RECIPES)}) at --seed SEED (repeatable)")
    p.add_argument("--member", action="append", default=[], metavar="DIR",
                   help="a classifier (finetune/train.py --save) or TF-IDF model trained elsewhere (repeatable)")
    p.add_argument("--tfidf", action="store_true", help="fit the TF-IDF model on the members' training part")
    p.add_argument("--base", default=None, help="base model of the trained members (with --recipe)")
    p.add_argument("--train", default=None, help="training file (default: the one the members record)")
    p.add_argument("--dev", default=None, help="dev file scored (default: the one the members record)")
    p.add_argument("--test", default=None, help="also predict (and score, if labelled) this file")
    p.add_argument("--holdout", type=probability(open_low=True, open_high=True), default=None,
                   help=f"held-out fraction of train (default: the members', else {DEFAULT_HOLDOUT})")
    p.add_argument("--holdout-seed", type=non_negative_int, default=None,
                   help=f"seed of the held-out split (default: the members', else {DEFAULT_HOLDOUT_SEED})")
    p.add_argument("--threshold-objective", choices=["micro", "macro", "balanced", "mean"], default="mean",
                   help="what the per-class thresholds maximise (finetune.train --help says each)")
    p.add_argument("--threshold-bagging", type=non_negative_int, default=100, metavar="N",
                   help="average the thresholds over N bootstrap resamples of the held-out tweets (0: no bagging)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward of a member")
    add_dtype_arg(p, default="bfloat16", help="dtype the members compute their probabilities in")
    p.add_argument("--force", action="store_true", help="rebuild an ensemble this command wrote in --save")
    args = p.parse_args(argv)
    args.extra = extra
    args.recipes = [_recipe(p, spec) for spec in args.recipe]
    if not args.recipes and not args.member:
        p.error("no members: give --recipe NAME:SEED and/or --member DIR")
    if args.recipes and not (args.base and args.train and args.dev):
        p.error("--recipe trains members: give --base, --train and --dev")
    if args.holdout is not None and not 0.0 < args.holdout < 1.0:
        p.error(f"--holdout must be in (0, 1), got {args.holdout}")
    if len(args.recipes) + len(args.member) + args.tfidf < 2:
        p.error("an ensemble needs at least two members")
    return args


def _recipe(p, spec: str) -> tuple[str, int]:
    name, _, seed = spec.partition(":")
    if name not in RECIPES or not seed.lstrip("-").isdigit():
        p.error(f"--recipe {spec!r}: expected NAME:SEED with NAME one of {', '.join(RECIPES)} and SEED an integer")
    return name, int(seed)


@command
def main(argv=None) -> dict | None:
    args = parse_args(argv)
    from finetune.ensemble.assemble import run_ensemble  # noqa: PLC0415  (deferred: --help must not load torch)
    return run_ensemble(args)


cli = console_script(main)

if __name__ == "__main__":
    main()
