"""torchrun, ending in one line when a worker fails:

    python -m pipeline.launch --nproc_per_node 8 pipeline/pretrain.py --model-config ... [torchrun's arguments]

This is torchrun's own code (``torch.distributed.run.parse_args`` and ``run``: the same elastic agent,
rendezvous, restarts and environment as ``torchrun``), minus its ``main``'s ``@record``, which re-raises the
agent's ``ChildFailedError`` as a launcher traceback and a summary block. Here that error becomes one line,
naming the first rank that failed, its exit code or signal and its own line (the worker's error file,
``TORCHELASTIC_ERROR_FILE``, which the project's commands fill with their ``error: ...`` line):

    error: torchrun: rank 0 (pid 4242) failed first, exit code 2 (2 worker(s) failed): invalid model config ...

and the launcher exits with that worker's exit code (1 for a signal). The deepspeed launcher (the documented
one) needs none of this: it ends a failed job with one log line, ``... exits with return code = 2``.
"""
from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main", "summary"]


def summary(error: ChildFailedError) -> tuple[str, int]:
    """The one line of a failed job and the exit code to leave with."""
    rank, failure = error.get_first_failure()
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):  # an error file in torch's own format {"message": {"message": ...}}
        message = message.get("message", "")
    message = " ".join(str(message).split()).removeprefix("error: ")
    said = f": {message}" if message and not message.startswith("To enable traceback") else ""
    line = (f"error: torchrun: rank {rank} (pid {failure.pid}) failed first, {how} "
            f"({len(error.failures)} worker(s) failed){said}")
    return line, failure.exitcode if failure.exitcode > 0 else 1


def main(argv: list[str] | None = None) -> int:
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
