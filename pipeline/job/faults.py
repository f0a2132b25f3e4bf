"""What a cluster does to a job, handled at the job layer: preemption signals, non-finite losses, two runs on
one ``--save``. ``setup`` makes the run's ``Guard`` (``configure``); ``train_loop`` asks it after every step.

- Preemption: SIGTERM (what SLURM and Kubernetes send) or SIGUSR1 to any rank sets a flag; at the next
  optimizer-step boundary every rank learns of it (one all-reduce a step, the same one that carries the
  non-finite flag), the step is treated as the last (the commands' save hooks write a complete checkpoint),
  and the loop ends; the command exits 0. ``--no-exit-signal-handler`` keeps the default signal behaviour.
  A second signal, or no step boundary within ``PIPELINE_STOP_GRACE_S`` seconds (default 600) of the first,
  ends the process at once by that signal, without saving (a step that never finishes, a timeout's SIGTERM
  followed by another).
- A non-finite loss or gradient (bf16/fp32; fp16 keeps DeepSpeed's loss scaling, which skips such steps
  itself; the gradients are checked by ``pipeline.engine.grad_watch``, read with the loss): the step's hooks
  do not run (no log record, no checkpoint of that state); after ``--max-bad-steps`` such steps
  the run stops with one line naming the steps and the last good checkpoint (exit code 2).
- The run lock: ``<save>/.run.lock`` (host, pid, start time) held with ``flock`` by rank 0 for the job's
  life; a second run on the same ``--save`` is refused at start naming the holder. The kernel drops a flock
  when its holder dies (kill -9 included), so a crashed run's successor takes the lock over.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from models.parallel import get_parallel_state
from pipeline.engine.steps import nonfinite_grad
from pipeline.job.errors import UserError
from pipeline.job.files import refuse_links_out
from pipeline.job.numbers import parse_number, positive_float

__all__ = ["Guard", "configure", "current", "RunLockError", "NonFiniteLossError", "PeerFailure", "is_peer_failure",
           "acquire_run_lock", "LOCK_FILE", "STOP_SIGNALS"]

LOCK_FILE = ".run.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunLockError(UserError, RuntimeError):
    """Another run holds the lock of this ``--save`` directory."""


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss was NaN or Inf on more steps than ``--max-bad-steps`` allows."""
    exit_code = 1  # a fault of the run, not of its arguments (2)


class PeerFailure(UserError, RuntimeError):
    """A collective failed: another rank died, or stopped answering for ``--distributed-timeout-minutes``."""
    exit_code = 1
    every_rank = True  # rank 0 may be the one that died: whichever rank sees it says so


_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe",
               "NCCL", "ProcessGroup", "Gloo", "gloo")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because of another rank (not a bug of this one)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error) for w in _PEER_WORDS)


GRACE_ENV = "PIPELINE_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 600.0


def stop_grace_s() -> float:
    """How long a stop signal waits for the step in progress (``PIPELINE_STOP_GRACE_S``, default 600 s)."""
    text = os.environ.get(GRACE_ENV)
    return DEFAULT_STOP_GRACE_S if text is None else parse_number(text, GRACE_ENV, positive_float)


class StopWatch:
    """Ends the process when a stop signal is not heeded: at a second stop signal, or when no step boundary
    comes within ``grace_s`` of the first. A thread reads the signals from the interpreter's wakeup fd, which
    the C-level handler writes at once: it works while the main thread is stuck inside one long C call (a
    collective, a kernel), where Python's own handler would not run until the call returns."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.boundary = threading.Event()
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._closed = False
        threading.Thread(target=self._watch, name="stop-watch", daemon=True).start()

    def _watch(self) -> None:
        received, deadline = [], None
        while not self._closed:
            timeout = None if deadline is None or self.boundary.is_set() else max(deadline - time.monotonic(), 0)
            ready, _, _ = select.select([self._read], [], [], timeout)
            data = os.read(self._read, 64) if ready else b""
            if self._closed:
                break
            received += [signal.Signals(n) for n in data if n in STOP_SIGNALS]
            if len(received) >= 2:
                _end_now(received[-1], f"a second stop signal ({received[-1].name}) received: ending the job now, "
                                       f"without saving")
            if received and deadline is None:
                deadline = time.monotonic() + self.grace_s
            if deadline is not None and not ready and not self.boundary.is_set():
                _end_now(received[0], f"{received[0].name} received and no step completed within "
                                      f"{self.grace_s:g} s ({GRACE_ENV}): ending the job now, without saving")
        os.close(self._read)  # by the thread itself: closed only once nothing waits on it

    def close(self) -> None:
        """The wakeup fd back to what it was, then the thread woken (a byte that is no signal, or the pipe's end)
        and the write end closed: the thread ends and closes the read end."""
        self._closed = True
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous)
        with contextlib.suppress(OSError):  # the thread may have closed its end already
            os.write(self._write, b"\0")
        os.close(self._write)


def _end_now(signum: int, why: str) -> None:
    """From the watch thread: the line, then the exit status of a process ended by ``signum`` (128 + it; the
    atexit handlers do not run: the run lock's flock goes with the process)."""
    print(f"error: rank {_rank()}: {why}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


@dataclass
class Guard:
    """The run's stop flag (set by a signal), its non-finite steps, and where its checkpoints go."""
    save: Path | None = None
    max_bad_steps: int = 1
    check_finite: bool = True
    signal_name: str | None = None
    bad_steps: list = field(default_factory=list)
    installed: tuple = ()
    grace_s: float = DEFAULT_STOP_GRACE_S
    watch: "StopWatch | None" = None

    def install(self) -> None:
        with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
            self.installed = tuple((sig, signal.signal(sig, self._on_signal)) for sig in STOP_SIGNALS)
            self.watch = StopWatch(self.grace_s)

    def uninstall(self) -> None:
        """The signals' earlier handlers back (the loop is over: a signal now acts as it did before)."""
        for sig, previous in self.installed:
            signal.signal(sig, previous)
        self.installed = ()
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"{self.signal_name} received: stopping after this step (if no step completes within "
                  f"{self.grace_s:g} s, or a second signal comes, the job ends without saving)", file=sys.stderr,
                  flush=True)

    def after_step(self, step: int, out) -> tuple[bool, bool]:
        """(stop now, this step was bad: a loss or a gradient not finite), the same on every rank (collective)."""
        if os.environ.get("PIPELINE_SIGNAL_AT") == str(step):  # fault injection: the preemption tests' SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
        loss = _loss_of(out)
        bad_loss = self.check_finite and loss is not None and not math.isfinite(loss)
        bad_grad = self.check_finite and nonfinite_grad() is not None
        stop, bad_loss, bad = (bool(f) for f in _agree([self.signal_name is not None, bad_loss, bad_loss or bad_grad]))
        if stop and self.signal_name is None:
            self.signal_name = "a stop signal to another rank"
        if stop and self.watch is not None:
            self.watch.boundary.set()  # the save and the stop now take the time they need
        if bad:
            self._bad(step, loss, bad_loss)
        return stop, bad

    def _bad(self, step: int, loss, bad_loss: bool) -> None:
        self.bad_steps.append(step)
        grad = _first_over_ranks(nonfinite_grad())  # collective, on bad steps only
        if bad_loss:
            what = f"the loss is {loss}" if not math.isfinite(loss) else "the loss is not finite on another rank"
        else:
            what = "the loss is finite" + (f" ({loss:.6g})" if loss is not None else "") + " but a gradient is not"
        what += f", the first non-finite gradient: {grad}" if grad else ""
        if len(self.bad_steps) >= max(self.max_bad_steps, 1):
            steps = ", ".join(map(str, self.bad_steps[-5:]))
            raise NonFiniteLossError(
                f"step {step}: {what} ({len(self.bad_steps)} step(s) with a non-finite loss or gradient: {steps}; "
                f"--max-bad-steps {self.max_bad_steps}); the run stopped without saving them"
                f"{self._last_good()}; lower the learning rate, check the data, or resume from it with --load")
        if _rank() == 0:
            print(f"warning: step {step}: {what}; its state is not saved ({len(self.bad_steps)} of "
                  f"--max-bad-steps {self.max_bad_steps})", file=sys.stderr, flush=True)

    def _last_good(self) -> str:
        latest = self.save / "latest" if self.save else None
        if latest is not None and latest.is_file():
            return f" (the last good checkpoint: {self.save / latest.read_text().strip()})"
        return " (no checkpoint was saved before)"

    def peer_failure(self, step: int, error: BaseException) -> PeerFailure:
        cause = " ".join(str(error).split())[:160]
        return PeerFailure(
            f"rank {_rank()}: step {step}: a collective failed: another rank died or did not answer within "
            f"--distributed-timeout-minutes ({cause}){self._last_good()}; the launcher's summary names the rank "
            f"that failed; resume with --load {self.save or 'DIR'} once it is fixed")

    def stopped_message(self, step: int, last: int) -> str:
        saved = f": its state is saved in {self.save}" if self.save else " (no --save: nothing was saved)"
        return f"stopped by {self.signal_name} after step {step} of {last}{saved}"


_current = Guard(check_finite=False)


def current() -> Guard:
    return _current


def configure(save: str | None, *, exit_signal_handler: bool, max_bad_steps: int, fp16: bool) -> Guard:
    """The guard of the run ``setup`` starts (signals installed on every rank; the run lock taken by rank 0)."""
    global _current
    grace_s = stop_grace_s()
    _current.uninstall()  # a job of this process that ended before its loop (a notebook, tests): its handlers go
    _current = Guard(Path(save) if save else None, max_bad_steps, check_finite=not fp16 and max_bad_steps > 0,
                     grace_s=grace_s)
    if exit_signal_handler:
        _current.install()
    if save:
        acquire_run_lock(Path(save))
    return _current


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _loss_of(out) -> float | None:
    value = out.get("loss") if isinstance(out, dict) else out
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu().item() if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _first_over_ranks(local: tuple[int, str] | None) -> str | None:
    """The first non-finite gradient of all ranks: the earliest pipeline stage's, then the earliest parameter's
    (ranks of one stage share the parameter order)."""
    mine = None if local is None else (_pipe_stage(), *local)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    found = sorted(e for e in every if e is not None)
    return found[0][2] if found else None


def _pipe_stage() -> int:
    with contextlib.suppress(RuntimeError):  # no parallel state: a single process
        return get_parallel_state().get_pipe_parallel_rank()
    return 0


def _agree(flags: list[bool]) -> list[int]:
    """The max of each flag over all ranks (one all-reduce on the backend's device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [int(f) for f in flags]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -- the run lock ------------------------------------------------------------------------------------------------------

_held: dict = {}


def acquire_run_lock(save: Path) -> None:
    """Rank 0 takes ``save/.run.lock``; every rank learns whether it could (collective when distributed)."""
    problem = None
    if _rank() == 0:
        try:
            refuse_links_out(save)  # before the lock file or anything else is written there
            _lock(save)
        except UserError as e:
            problem = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise RunLockError(problem)


def _lock(save: Path) -> None:
    created = None if save.exists() else save  # a run refused before any work leaves no folder behind
    save.mkdir(parents=True, exist_ok=True)
    path = save / LOCK_FILE
    if str(path) in _held:
        return  # this process holds it already (a second job in one Python process, e.g. a notebook)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a link put there since: ELOOP, not followed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise RunLockError(f"{path}: --save {save} is in use by another run ({holder}); wait for it to end, or "
                           f"choose another --save (the lock goes when that process ends)") from None
    previous = _holder(fd)
    if previous != "unknown holder":
        print(f"note: {path}: took over the lock of a run that ended ({previous})", file=sys.stderr, flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode(), 0)
    os.fsync(fd)
    _held[str(path)] = fd
    import atexit  # noqa: PLC0415
    atexit.register(_release, path, fd, created)


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
        if isinstance(info, dict):
            return f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}"
    return "unknown holder"


def _release(path: Path, fd: int, created: Path | None = None) -> None:
    """The lock file goes when the run ends (a kill leaves it, unlocked: the next run takes it over), and so
    does the --save folder the lock made if nothing else was written into it."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    if created is not None:
        with contextlib.suppress(OSError):
            created.rmdir()  # only when empty
    with contextlib.suppress(OSError):
        os.close(fd)
    _held.pop(str(path), None)
