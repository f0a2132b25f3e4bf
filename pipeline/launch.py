"""torchrun, ending in one line when a worker fails:

    python -m pipeline.launch --nproc_per_node 8 pipeline/pretrain.py --model-config ... [torchrun's arguments]

This is torchrun's own code (``torch.distributed.run.parse_args`` and ``run``: the same elastic agent,
rendezvous, restarts and environment as ``torchrun``), minus its ``main``'s ``@record``, which re-raises the
agent's ``ChildFailedError`` as a launcher traceback and a summary block. Here that error becomes one line,
naming the first rank that exited with an error (else the first stopped), its exit code or signal and its own
line (the worker's error file, ``TORCHELASTIC_ERROR_FILE``, which the project's commands fill with their
``error: ...`` line):

    error: torchrun: rank 0 (pid 4242) failed first, exit code 2 (2 worker(s) failed): invalid model config ...

and the launcher exits with that worker's exit code (1 for a signal). Its own arguments are checked first, each
refusal one line (exit code 2): no script, ``--nproc_per_node`` neither a count from 1 to 1024 nor one of
torchrun's words (auto, cpu, gpu, xpu), any other error of torchrun's parser. The deepspeed launcher (the documented
one) needs none of this: it ends a failed job with one log line, ``... exits with return code = 2``.
"""
from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from pipeline.job.errors import InputError, reported_errors
from pipeline.job.numbers import int_in

__all__ = ["main", "summary"]


def first_failure(error: ChildFailedError):
    """(rank, failure) of the worker that failed first by its own exit: the earliest of those with an exit code,
    else the earliest. A worker the agent stopped (SIGTERM) after another exited can carry the earlier time (that of
    the error file it wrote before it was stopped), and would give the job a signal's exit code, not its error's."""
    exited = {rank: f for rank, f in error.failures.items() if f.exitcode > 0}
    failures = exited or error.failures
    rank = min(failures, key=lambda r: failures[r].timestamp)
    return rank, failures[rank]


def summary(error: ChildFailedError) -> tuple[str, int]:
    """The one line of a failed job and the exit code to leave with."""
    rank, failure = first_failure(error)
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):  # an error file in torch's own format {"message": {"message": ...}}
        message = message.get("message", "")
    message = " ".join(str(message).split()).removeprefix("error: ")
    said = f": {message}" if message and not message.startswith("To enable traceback") else ""
    line = (f"error: torchrun: rank {rank} (pid {failure.pid}) failed first, {how} "
            f"({len(error.failures)} worker(s) failed){said}")
    return line, failure.exitcode if failure.exitcode > 0 else 1


PROG = "mds-launch"  # the one program name of this command, as its console script
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
MAX_NPROC = 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's own parser, its errors one line (not its usage block), ``--nproc_per_node`` checked before
    any worker starts (0 would start none; ``abc`` is torchrun's traceback)."""
    if not argv:
        raise InputError(f"{PROG}: give the script to run and its arguments, e.g. {PROG} --nproc_per_node 2 "
                         f"pipeline/pretrain.py --model-config ...; see {PROG} --help")
    parser = get_args_parser()
    parser.prog = PROG

    def error(message: str):
        raise InputError(f"{PROG}: {message}; see {PROG} --help")
    parser.error = error
    args = parser.parse_args(argv)
    if args.nproc_per_node not in NPROC_WORDS:
        try:
            int_in(1, MAX_NPROC)(args.nproc_per_node)
        except argparse.ArgumentTypeError as e:
            error(f"argument --nproc_per_node: {e} (or one of {', '.join(NPROC_WORDS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    with reported_errors(argv):
        args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        line, code = summary(e)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


cli = main  # the console script (pyproject.toml), torchrun's arguments from sys.argv

if __name__ == "__main__":
    sys.exit(main())
