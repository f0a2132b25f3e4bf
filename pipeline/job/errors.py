"""User errors and the one top-level handler every command uses.

A user error is reported as one line on stderr, by rank 0 only, and the process exits with code 2 (a fault of
the run rather than of its inputs, e.g. ``faults.NonFiniteLossError``, sets ``exit_code = 1``; one that any rank
may be the only one to see, ``faults.PeerFailure``, sets ``every_rank``):

    error: <file/line/field>: <what>; <what to do>

No traceback, unless ``--debug`` is on the command line or ``PIPELINE_DEBUG=1`` is in the environment
(then the traceback comes first, the same line last, and the exit code is still 2).

How a command uses it:

    from pipeline.job.errors import UserError, add_debug_arg, command

    class MyError(UserError, ValueError): ...     # a module's own error class derives from UserError

    @command                                       # main(argv) -> int | dict | None
    def main(argv=None):
        p = ArgumentParser(...)                    # argparse, its errors one line, --debug added
        ...
        raise MyError(f"{path}: line {n}: field 'text' is empty; fill it or drop the line")

``command`` also works when ``main(argv)`` is called from Python (tests, notebooks): a user error raises
``SystemExit(2)`` after the line is printed. A command whose Python callers want the exception itself
(``pipeline.pretrain``, ``pipeline.evaluate``) decorates only its entry point: ``command(main)()``.
The message of the exception is the part after ``error: ``; write it as ``<where>: <what>; <what to do>``.
Besides ``UserError`` subclasses, the handler reports the model layer's ``ConfigError`` and
``ParallelConfigError`` (models/ does not import pipeline/) and the OS errors a wrong path causes (file not
found, exists, is a directory, not a directory, permission).
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

from pipeline.job.config_file import add_config_arg, config_path, config_words

__all__ = ["UserError", "InputError", "ArgumentParser", "is_user_error", "is_rank0", "format_user_error",
           "reported_errors", "command", "start_command", "add_debug_arg",
           "EXIT_USER_ERROR", "DEBUG_ENV"]

EXIT_USER_ERROR = 2
DEBUG_ENV = "PIPELINE_DEBUG"
_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


class UserError(Exception):
    """Something the user handed in or asked for is wrong; the message says where, what, and what to do."""
    user_error = True  # what a command reports in one line; the models' own errors say so too (``user_error``)


class InputError(UserError, ValueError):
    """A malformed input file or argument value, for modules without an error class of their own."""


def is_user_error(error: BaseException) -> bool:
    """A ``UserError``, an error of a lower layer marked ``user_error`` (the model configs' and the layout's), or a
    path the user gave that the OS refused. This module imports nothing above it: the marker, not the class."""
    return getattr(type(error), "user_error", False) or isinstance(error, _PATH_ERRORS)


def format_user_error(error: BaseException) -> str:
    """The one line: ``error: <message>`` with the message's line breaks folded."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror and len(error.args) == 2:
        # raised by the OS itself (open, mkdir, ...), not with a message of ours
        message = f"{error.filename}: {error.strerror.lower()}; check the path"
    else:
        message = str(error) or type(error).__name__
    return "error: " + re.sub(r"\s*\n\s*", " ", message.strip())


def _process_group():
    """``torch.distributed`` when this process has joined a process group, else None. Read from ``sys.modules``: a
    process that never imported it (a parser, ``--help``, an error before any work) has no group, and importing it
    here would load torch into every command's start."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def is_rank0() -> bool:
    """Whether this process is rank 0: of the process group once joined, else as the launcher numbered it."""
    dist = _process_group()
    if dist is not None:
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _debug(argv: Sequence[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def reported_errors(argv: Sequence[str] | None = None) -> Iterator[None]:
    """Turn a user error raised in the block into the one line on stderr and ``SystemExit(2)``."""
    try:
        yield
    except Exception as e:
        if not is_user_error(e):
            raise
        rank0 = is_rank0()
        if rank0 or getattr(e, "every_rank", False):
            if _debug(argv):
                traceback.print_exc()
            print(format_user_error(e), file=sys.stderr, flush=True)
        _leave_launcher_a_line(format_user_error(e), rank0)
        raise SystemExit(getattr(e, "exit_code", EXIT_USER_ERROR)) from None


def _leave_launcher_a_line(line: str, rank0: bool) -> None:
    """Under torchrun: the worker's one line in its error file (the agent's failure summary shows it in
    place of "To enable traceback see ..."), the process group left, and a rank other than 0 waits a moment
    so that rank 0's line is out before the agent stops the other workers. torchrun itself still raises its
    ``ChildFailedError`` summary whenever a worker exits non-zero (its ``main`` re-raises it: nothing a worker
    does avoids that)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and not os.path.exists(error_file):
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        partial = f"{error_file}.{os.getpid()}.tmp"  # renamed whole: the agent, stopping this worker, may read it
        with contextlib.suppress(OSError):
            with open(partial, "w") as f:
                json.dump(data, f)
            os.replace(partial, error_file)
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return  # not a torchrun worker: a caller in Python (a test, a notebook) keeps its process group
    dist = _process_group()
    if dist is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if not rank0:
        with contextlib.suppress(ValueError):  # the agent's stop ends this process, not a training step
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_DFL)
        time.sleep(1.0)


class _WithoutLines(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts``."""

    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


_QUIET = _WithoutLines("Setting accelerator to CPU")


def start_command() -> None:
    """What a command sets for its own process before it loads torch (importing the library sets nothing):

    * torch's large CPU allocations on 2 MB transparent huge pages instead of 4 KB pages faulted in after every free
      (measured on the E-c finetune, 2 cores: 178k -> 16k page faults/s, 3.7 -> 2.2 s per step). torch reads
      ``THP_MEM_ALLOC_ENABLE`` at its first CPU allocation; it does nothing on GPU tensors, and a user's own setting
      (``THP_MEM_ALLOC_ENABLE=0``) wins.
    * DeepSpeed's "Setting accelerator to CPU ..." warning, which every CPU run printed on import: the run is on the
      CPU on purpose. Its logger keeps every other line (a filter on that one message, added before DeepSpeed
      creates the logger, which keeps filters).
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if _QUIET not in deepspeed_logger.filters:
        deepspeed_logger.addFilter(_QUIET)


def command(main: Callable) -> Callable:
    """Decorate a command's ``main(argv=None)`` so that every user error it raises is reported once; the process
    is set up for the command first (``start_command``)."""
    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None, *args, **kwargs):
        start_command()
        with reported_errors(argv):
            return main(argv, *args, **kwargs)
    return wrapper


def console_script(main: Callable) -> Callable[[], int]:
    """The entry point of a command's console script (pyproject's ``[project.scripts]``): user errors reported
    as by ``command``, the result as the exit status (an int is one; a result dict or path means success)."""
    run = main if hasattr(main, "__wrapped__") else command(main)

    def entry() -> int:
        result = run()
        return result if type(result) is int else 0
    return entry


def job_command(parse_args: Callable, job: Callable[[], Callable], module_name: str
                ) -> tuple[Callable, Callable[[], int]]:
    """A command's ``main(argv=None)`` (as ``command``: user errors reported once) and its console script: the
    arguments parsed, then ``job()`` gives the function that runs them, imported only then (``--help`` loads no
    torch). ``module_name``: the command module's ``__name__``; run as ``python -m``, the command runs at once and
    exits with the console script's status."""
    @command
    def main(argv: Sequence[str] | None = None):
        return job()(parse_args(argv))

    cli = console_script(main)
    if module_name == "__main__":
        sys.exit(cli())
    return main, cli


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (the commands' docstrings hold their example lines), and each flag's default at
    the end of its help line, unless the line says it already or there is none to say (no value, a switch off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS)
                or text == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (a missing or malformed flag) are user errors like any other: one line
    ``error: <prog>: <what>; see --help``, exit 2, through ``command``'s handler, without the usage block.
    Help shows the description as written and every default (``HelpFormatter``). Every command takes
    ``--config FILE``: its flags from a YAML/TOML/JSON file, the command line overriding it
    (``pipeline.job.config_file``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        add_debug_arg(self)  # every command takes --debug
        add_config_arg(self)

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        path = config_path(argv)
        if path is not None:
            argv = config_words(self, path, argv) + argv
        return super().parse_known_args(argv, namespace)

    def error(self, message: str):
        raise InputError(f"{self.prog}: {message}; see {self.prog} --help")


def add_debug_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of a user error too (or set {DEBUG_ENV}=1)")
