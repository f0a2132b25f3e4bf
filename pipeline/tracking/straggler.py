"""The slow rank, named, as Megatron's ``StragglerDetector`` does: every ``--straggler-interval`` steps each rank's
compute time over the last steps is gathered (one all-gather of one number), and the slowest rank is written
with its ratio to the other ranks' median to metrics.jsonl and the monitor (``<prefix>/straggler_rank``,
``<prefix>/straggler_ratio``, ...); above ``--straggler-threshold`` rank 0 also prints one warning line:

    warning: step 40: rank 1 is the slowest: 2.31 s of compute over the last 20 steps, 3.52x the other ranks' ...

A rank's compute time is the CPU time of its main thread between two step boundaries: the time it spends
blocked in a collective, waiting for the others, is not in it (measured over gloo: the waiting rank's 3 steps
took 7 ms of CPU time while it waited 0.75 s for the other), so a rank that computes more (a slower host, a
longer data step, a throttled CPU) stands out. With CUDA the kernels run
asynchronously: there the figure is the host side of the step (launches, data, Python), which names a slow
host, not a slow GPU.

Debug: ``PIPELINE_DELAY_RANK=<rank>:<seconds>`` makes that rank compute (spin) that long more at every step,
to see the detector name it (the straggler test does so).

Wiring, by a command that trains: ``hooks=[straggler_hook(args.straggler_interval, metrics,
threshold=args.straggler_threshold), ...]`` (the hook times every step; it is collective on report steps, so
every rank must run it, and before any hook that may skip a rank).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.job.arguments import STRAGGLER_THRESHOLD, add_straggler_args  # noqa: F401 (re-exported)
from pipeline.job.errors import InputError

__all__ = ["StragglerDetector", "straggler_hook", "add_straggler_args", "DELAY_ENV", "debug_delay"]

DELAY_ENV = "PIPELINE_DELAY_RANK"
DEFAULT_THRESHOLD = STRAGGLER_THRESHOLD


def debug_delay(rank: int) -> float:
    """The seconds ``PIPELINE_DELAY_RANK=<rank>:<seconds>`` adds to each step of ``rank`` (0 for the others)."""
    text = os.environ.get(DELAY_ENV)
    if not text:
        return 0.0
    try:
        which, seconds = text.split(":")
        delayed, seconds = int(which), float(seconds)
    except ValueError:
        raise InputError(f"{DELAY_ENV}={text!r}: give <rank>:<seconds>, e.g. 1:0.5") from None
    if not 0 <= seconds < 3600:
        raise InputError(f"{DELAY_ENV}={text!r}: the seconds must be from 0 to 3600")
    return seconds if delayed == rank else 0.0


def _spin(seconds: float) -> None:
    """Busy compute, not sleep: a sleeping rank would use no CPU time, as a slow one does."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass
class StragglerDetector:
    """Each rank's compute seconds per interval; ``report`` (collective) gathers them."""
    interval: int
    threshold: float = DEFAULT_THRESHOLD
    seconds: float = 0.0
    steps: int = 0
    _mark: float = field(default_factory=time.thread_time)

    def step_done(self) -> None:
        now = time.thread_time()
        self.seconds += now - self._mark
        self.steps += 1
        self._mark = now

    def report(self, step: int) -> dict:
        """Every rank's compute seconds since the last report, the slowest rank and its ratio to the median."""
        every = _all_gather(self.seconds)
        steps, self.seconds, self.steps = self.steps, 0.0, 0
        slowest = max(range(len(every)), key=every.__getitem__)
        # the median of the other ranks: with two ranks the median of all is the midpoint (a ratio of 2 at most)
        median = statistics.median(every[:slowest] + every[slowest + 1:]) if len(every) > 1 else every[0]
        ratio = every[slowest] / median if median > 0 else 1.0
        return {"step": step, "straggler_rank": slowest, "straggler_ratio": round(ratio, 4),
                "straggler_seconds": round(every[slowest], 6), "median_rank_seconds": round(median, 6),
                "fastest_rank_seconds": round(min(every), 6), "straggler_steps": steps}

    def warning(self, record: dict) -> str | None:
        if record["straggler_ratio"] <= self.threshold:
            return None
        return (f"warning: step {record['step']}: rank {record['straggler_rank']} is the slowest: "
                f"{record['straggler_seconds']:.3g} s of compute over the last {record['straggler_steps']} steps, "
                f"{record['straggler_ratio']:.2f}x the other ranks' median {record['median_rank_seconds']:.3g} s "
                f"(--straggler-threshold {self.threshold:g}); check that rank's host")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_gather(value: float) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64, device=device))
    return [t.item() for t in out]


def straggler_hook(interval: int | None, metrics=None, *, threshold: float = DEFAULT_THRESHOLD) -> Callable:
    """A ``job.loop`` hook (it takes the ``StepResult``): times every step, and every ``interval`` steps (and at
    the last) writes the straggler record to ``metrics`` (a ``MetricsWriter``, prefix ``straggler`` on the
    monitor) and prints the warning on rank 0. ``interval`` None: a hook that does nothing (the debug delay
    included)."""
    if not interval:
        return lambda r: None
    detector, delay = StragglerDetector(interval, threshold), debug_delay(_rank())

    def hook(r) -> None:
        if delay:
            _spin(delay)
        detector.step_done()
        if r.step % interval and not r.last:
            return
        record = detector.report(r.step)
        if metrics is not None:
            metrics.write(record)
        line = detector.warning(record)
        if line and _rank() == 0:
            r.bar.write(line, file=sys.stderr)  # a line of its own below the progress bar
    return hook
