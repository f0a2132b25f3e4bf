"""Asynchronous checkpoints (``pretrain --async-save``): training goes on while the state of the step being saved
is written.

The save of step N runs in two parts:

1. On the training's path (every rank, at the step boundary): DeepSpeed's own ``save_checkpoint`` builds each
   file's state dict as in a synchronous save, but the checkpoint engine it writes through
   (``StagingCheckpointEngine``) copies each state dict to host memory instead of writing it, with torch
   distributed checkpoint's stager (``DefaultStager``: one copy per storage, views kept as views, so
   ``torch.save`` later writes the very bytes a synchronous save writes; pinned memory and a non-blocking copy
   on a GPU; the host buffers are kept and reused by the next save). The rank's data position and RNG streams
   and the tag's layout.json are taken at the same moment.
2. In a thread of each rank: the staged files are written (hashed as they go out, fsynced), then, over a gloo
   group of their own, the ranks gather their files' sha256 and rank 0 writes layout.json, ``COMPLETE.json`` and
   only then moves ``latest``: a checkpoint is complete or invisible exactly as a synchronous one, and a kill -9
   during the write leaves the previous checkpoint as ``latest``.

Why this and not DeepSpeed's decoupled engine or torch DCP's ``async_save``: DCP writes its own format
(``.distcp`` files), which DeepSpeed's loader, the universal conversion and ``export_hf`` do not read;
DeepSpeed 0.19's ``DecoupledCheckpointEngine`` hands the live tensors to a writer process through a
multiprocessing queue (no snapshot: on CPU they move into shared memory in place and the next optimizer step
changes them while they are written), needs its FastFileWriter (DeepNVMe's async I/O) configuration, commits
inside the next ``engine.step`` (so the next step waits for the whole write) and writes ``latest`` itself, before
any manifest. Staging through DeepSpeed's own checkpoint-engine interface keeps its file layout, and the loads
(``checkpoint.load``, ``universal``, ``export_hf``) read an asynchronously saved run like any other.

Waiting: a save first waits for the previous one; at every step boundary while a write is in flight the ranks
agree (one small all-reduce over a second gloo group) whether every rank's write has finished, and an error of the
write (a full disk: the same one line as a synchronous save, naming the tag and the bytes, the partial tag
removed) is raised there on every rank; the last step's save (the end of the job, or a stop signal: SIGTERM
preemption) waits for its write before the loop ends; leaving the saver (``with``) waits for what is in flight.

Host memory: a second copy of what a rank saves (weights, fp32 master weights and Adam moments), kept for the run.

Fault injection for the tests: ``PIPELINE_ASYNC_SAVE_DELAY_S=<s>`` delays each background write by that many
seconds; ``PIPELINE_CRASH_AT=async-save-in-flight:<step>`` kills the process (SIGKILL) at the boundary of
``<step>`` if a write is still in flight then (``pipeline.job.files.crash_point``).
"""
from __future__ import annotations

import os
import threading
import typing
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.checkpoints import checkpoint, safe_load
from pipeline.job.arguments import add_async_save_args  # noqa: F401 (re-exported)
from pipeline.job.files import DiskFullError, crash_point, disk_full_cause

if typing.TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

__all__ = ["AsyncSaver", "SyncSaver", "StagingCheckpointEngine", "add_async_save_args", "make_saver"]

DELAY_ENV = "PIPELINE_ASYNC_SAVE_DELAY_S"


def make_saver(engine, save_dir, layout: dict, asynchronous: bool):
    """The pretraining job's saver: ``save(step, data_state, last=)`` at the save steps, ``poll`` as a hook at
    every step boundary, used as a context manager around the loop."""
    return (AsyncSaver if asynchronous and save_dir else SyncSaver)(engine, Path(save_dir) if save_dir else None,
                                                                     layout)


class SyncSaver:
    """``checkpoint.save`` on the training's path."""

    def __init__(self, engine, save_dir: Path | None, layout: dict):
        self.engine, self.save_dir, self.layout = engine, save_dir, layout

    def save(self, step: int, data_state, *, last: bool = False) -> None:
        checkpoint.save(self.engine, self.save_dir, step, data_state=data_state, layout=self.layout)

    def poll(self, result=None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class StagingCheckpointEngine(safe_load.SafeCheckpointEngine):
    """The safe engine whose ``save`` stages the state dict in host memory (``staged``: [(path, state dict)])."""

    def __init__(self, stager: DefaultStager, zipfile_serialization: bool):
        super().__init__(zipfile_serialization=zipfile_serialization)
        self.stager = stager
        self.staged: list[tuple[str, object]] = []

    def save(self, state_dict, path: str):
        staged = self.stager.stage(state_dict)
        _keep_requires_grad(state_dict, staged)
        self.staged.append((path, staged))


def _keep_requires_grad(source, staged) -> None:
    """The staged copies' ``requires_grad`` as the originals' (torch.save records it; the stager's copies are
    plain): what makes the file the same bytes as a synchronous save's (ZeRO's fp32 partitions, views of
    leaves, require grad)."""
    if isinstance(source, torch.Tensor):
        if source.requires_grad:
            staged.requires_grad_(True)
    elif isinstance(source, dict):
        for key, value in source.items():
            _keep_requires_grad(value, staged[key])
    elif isinstance(source, (list, tuple)):
        for value, copy in zip(source, staged):
            _keep_requires_grad(value, copy)


@dataclass
class _Write:
    """One save in flight: what the writer thread writes, and what it found."""
    step: int
    tag_dir: Path
    staged: list
    layout_text: str
    estimate: int
    zipfile_serialization: bool
    error: BaseException | None = None  # the same one on every rank once the write has ended
    thread: threading.Thread | None = field(default=None, repr=False)


class AsyncSaver:
    """Saves whose writes run in a background thread (the module's docstring). Collective: every rank makes it
    and calls ``save``, ``poll`` and ``__exit__`` at the same points."""

    def __init__(self, engine, save_dir: Path | None, layout: dict):
        self.engine, self.save_dir, self.layout = engine, save_dir, layout
        # (torch distributed checkpoint costs every job ~1 s of imports: only a run with --async-save pays it)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self.writer_group = dist.new_group(backend="gloo")  # the writers' collectives, off the training's group
        self.poll_group = dist.new_group(backend="gloo")  # the main threads' "every write done?"
        self.write: _Write | None = None

    def save(self, step: int, data_state, *, last: bool = False) -> None:
        """Stage the state of ``step`` and start its write (after the previous write has ended); the last step's
        save waits for its write."""
        self.wait()
        self.write = self._stage(step, data_state)
        self.write.thread = threading.Thread(target=self._write, args=(self.write,), name=f"checkpoint-{step}",
                                             daemon=True)
        self.write.thread.start()
        if last:
            self.wait()

    def _stage(self, step: int, data_state) -> _Write:
        try:
            return self._stage_files(step, data_state)
        except OSError as e:  # a full disk while DeepSpeed makes the tag's directories
            if disk_full_cause(e) is None:
                raise
            checkpoint.remove_partial_tag(self.save_dir / checkpoint.tag_for_step(step))
            raise checkpoint.save_disk_full(e, self.save_dir, step, checkpoint.estimate_bytes(self.engine)) from None

    def _stage_files(self, step: int, data_state) -> _Write:
        engine = self.engine
        tag_dir, client_state = checkpoint.begin_tag(engine, self.save_dir, step)
        safe = engine.checkpoint_engine  # a safe_load.SafeCheckpointEngine (build_engine installs it)
        staging = StagingCheckpointEngine(self.stager, safe.zipfile_serialization)
        engine.checkpoint_engine = staging  # what engine.save_checkpoint writes through, for this save
        try:
            engine.save_checkpoint(str(self.save_dir), tag=tag_dir.name, client_state=client_state, save_latest=False)
        finally:
            engine.checkpoint_engine = safe
        staging.save(checkpoint.rank_state(data_state), str(tag_dir / f"rank{dist.get_rank()}_state.pt"))
        return _Write(step, tag_dir, staging.staged, checkpoint.layout_text_of(engine, self.layout, step),
                      checkpoint.estimate_bytes(engine), safe.zipfile_serialization)

    def _write(self, write: _Write) -> None:
        """The writer thread: this rank's files, then (over the writer group) the tag committed by rank 0 once
        every rank's are written, or removed if any rank's write failed."""
        digests, failure = {}, None
        try:
            time.sleep(float(os.environ.get(DELAY_ENV, 0)))
            for path, state in write.staged:
                digests[str(Path(path).resolve())] = safe_load.save_hashed(
                    state, path, zipfile_serialization=write.zipfile_serialization)
            crash_point(f"after-deepspeed-files:{write.step}")
        except Exception as e:  # every rank takes part in the gather below, whatever happened here
            failure = e
        write.staged = []  # the host copies go back to the stager's cache
        try:
            everyone = _gather_objects((digests, None if failure is None else _describe(failure)), self.writer_group)
            outcome = None
            if dist.get_rank() == 0:
                outcome = _commit(write, {k: v for d, _ in everyone for k, v in d.items()}, [f for _, f in everyone])
            write.error = _error(_broadcast(outcome, self.writer_group), failure)
        except Exception as e:  # a collective that failed (a rank died): never a save taken for done
            write.error = e

    def poll(self, result=None) -> None:
        """At a step boundary (a hook): if every rank's write has ended, the save is over (its error raised on
        every rank); else training goes on."""
        if self.write is None:
            return
        done = torch.tensor([int(not self.write.thread.is_alive())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.poll_group)
        if done.item():
            self.wait()
        elif result is not None:
            crash_point(f"async-save-in-flight:{result.step}")

    def wait(self) -> None:
        """The write in flight ended (collective: every rank calls it at the same point); its error raised."""
        write, self.write = self.write, None
        if write is not None:
            write.thread.join()
            if write.error is not None:
                raise write.error

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is None:
            self.wait()
        elif self.write is not None:  # the job failed: the write ends on its own (its error is not this one)
            self.write.thread.join()
            self.write = None
        self.stager.close()


def _describe(error: BaseException) -> tuple[str, object]:
    """What a rank sends of its failed write: ("disk_full", errno), or ("other", one line)."""
    cause = disk_full_cause(error)
    if cause is not None:
        return "disk_full", cause.errno
    return "other", f"rank {dist.get_rank()}: the background write failed: {type(error).__name__}: {error}"


def _commit(write: _Write, digests: dict, failures: list) -> tuple[str, str] | None:
    """Rank 0, once every rank's write has ended: the tag committed (layout.json, COMPLETE.json, then latest), or,
    if a write failed, removed; returns the first failure (or the commit's own) as (kind, one line), else None."""
    failure = next((f for f in failures if f is not None), None)
    if failure is None:
        try:
            checkpoint.commit_tag(write.tag_dir, write.step, digests, write.layout_text)
            return None
        except Exception as e:
            failure = _describe(e)
    checkpoint.remove_partial_tag(write.tag_dir)
    kind, what = failure
    if kind == "disk_full":  # the synchronous save's line, the free bytes counted once the partial tag is gone
        what = str(checkpoint.save_disk_full(OSError(what, os.strerror(what)), write.tag_dir.parent, write.step,
                                             write.estimate))
    return kind, f"{what} (writing {write.tag_dir})" if kind == "other" else what


def _error(outcome: tuple[str, str] | None, local: BaseException | None) -> BaseException | None:
    """The error every rank raises for rank 0's ``outcome``: the same line on every rank (rank 0 prints it)."""
    if outcome is None:
        return None
    kind, line = outcome
    if kind == "disk_full":
        error = DiskFullError(line, disk_full_cause(local))
        error.every_rank = False  # every rank has the same line: rank 0 says it
        return error
    return local if local is not None else RuntimeError(line)


def _gather_objects(obj, group) -> list:
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def _broadcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
