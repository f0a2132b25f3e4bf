"""Step timing, the metrics.jsonl log of a run, and the same records sent to DeepSpeed's monitor.

The monitor is DeepSpeed's own (``engine.monitor``, a ``deepspeed.monitor.MonitorMaster``): the
``tensorboard``, ``wandb`` and ``csv_monitor`` sections of the DeepSpeed config turn its writers on, and it
writes on global rank 0 only. Every numeric field of a record goes to it as ``<prefix>/<field>`` with the
record's optimizer step as x-axis (DeepSpeed's own events, ``Train/Samples/*``, count samples instead).
W&B keeps one step counter per run, which DeepSpeed's events drive with the sample count, so there the
records carry their step as the field ``<prefix>/step``, declared their x-axis with ``wandb.define_metric``.

One run, one series: a run that starts at step N (resumed from the checkpoint of step N, or N = 0) first drops the
records of its directory's metrics.jsonl after step N (what an earlier command of the run logged past its last
checkpoint, which this one logs again). The run's settings go to the monitors once (``log_settings``): W&B's run
config, TensorBoard's hparams.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from pipeline.job.files import atomic_write_text, open_append

MONITOR_SECTIONS = ("tensorboard", "csv_monitor")


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


def place_monitor_outputs(ds: dict, run_dir: Path | None) -> dict:
    """Monitor files go inside the run: a tensorboard/csv_monitor section without an ``output_path`` gets
    ``<run_dir>/<section>`` (DeepSpeed would write to the working directory), and W&B's offline files go to
    ``<run_dir>`` unless WANDB_DIR says otherwise. The config is returned changed only there."""
    if run_dir is None:
        return ds
    for section in MONITOR_SECTIONS:
        conf = ds.get(section)
        if isinstance(conf, dict) and conf.get("enabled") and not conf.get("output_path"):
            ds = {**ds, section: {**conf, "output_path": str(Path(run_dir) / section)}}
    if isinstance(ds.get("wandb"), dict) and ds["wandb"].get("enabled") and "WANDB_DIR" not in os.environ:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_DIR"] = str(run_dir)
    return ds


def monitor_events(record: dict, prefix: str) -> list[tuple[str, float, int]]:
    """(tag, value, step) for every finite number of a record that has a step."""
    step = record.get("step")
    if step is None:
        return []
    return [(f"{prefix}/{k}", float(v), int(step)) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)]


class MetricsWriter:
    """One JSON record per line, flushed at once so a killed run keeps what it logged (rank 0 only), and the
    same records to DeepSpeed's monitor when one is given and enabled."""

    def __init__(self, path: Path | None, monitor=None, prefix: str = "train", start_step: int | None = None):
        self.path = path
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.prefix = prefix
        if self.monitor is not None and getattr(self.monitor, "wandb_monitor", None) is not None:
            # wandb is optional: only a config with a wandb section needs it
            import wandb  # noqa: PLC0415
            wandb.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if start_step is not None:
                drop_records_after(path, start_step)
            self._f = open_append(path)

    def log_settings(self, settings: dict) -> None:
        """The run's resolved settings (flat: ``args/...``, ``ds/...``) as W&B's config and TensorBoard's hparams."""
        if self.monitor is None:
            return
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v)) for k, v in settings.items()}
        if getattr(self.monitor, "wandb_monitor", None) is not None:
            import wandb  # noqa: PLC0415  (optional: only a config with a wandb section needs it)
            wandb.config.update(flat, allow_val_change=True)
        tb = getattr(self.monitor, "tb_monitor", None)
        if tb is not None and getattr(tb, "summary_writer", None) is not None:
            write_hparams(tb.summary_writer, flat)

    def write(self, record: dict):
        events = monitor_events(record, self.prefix) if self.monitor is not None else []
        if events:
            self._to_monitor(events, int(record["step"]))
        if self._f is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps({**clean, "time": time.time()}) + "\n")
        self._f.flush()

    def _to_monitor(self, events, step: int):
        m = self.monitor  # its writers exist on global rank 0 only
        for writer in (m.tb_monitor, m.csv_monitor, getattr(m, "comet_monitor", None)):
            if writer is not None:
                writer.write_events(events)
        if m.wandb_monitor is not None:
            m.wandb_monitor.log({**{tag: value for tag, value, _ in events}, f"{self.prefix}/step": step})

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.monitor is not None and getattr(self.monitor, "wandb_monitor", None) is not None:
            # wandb is optional: only a config with a wandb section needs it
            import wandb  # noqa: PLC0415
            wandb.finish()  # the offline run's files complete now, not at interpreter exit
        self.monitor = None


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites metrics.jsonl without the records of steps after ``step`` (atomically); returns how many went."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _step_of(line) is None or _step_of(line) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def write_hparams(writer, hparams: dict) -> None:
    """TensorBoard's hparams plugin summary of ``hparams`` into ``writer``'s own run (``SummaryWriter.add_hparams``
    would open another run beside it)."""
    from torch.utils.tensorboard.summary import hparams as hparams_summary  # noqa: PLC0415  (needs tensorboard)
    for summary in hparams_summary({k: v for k, v in hparams.items()}, {}):
        writer.file_writer.add_summary(summary)
    writer.flush()
