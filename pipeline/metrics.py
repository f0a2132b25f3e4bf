"""Step timing and the metrics.jsonl log of a run."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


class StepTimer:
    """Wall time of one step, synchronised with the device so queued kernels are counted."""

    def start(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def stop(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - self._t


class MetricsWriter:
    """One JSON record per line, flushed at once so a killed run keeps what it logged (rank 0 only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a")

    def write(self, record: dict):
        if self._f is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps({**clean, "time": time.time()}) + "\n")
        self._f.flush()

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = None
