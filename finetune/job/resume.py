"""A finetuning job that a cluster preempts continues where it stopped.

A stop signal (SIGTERM, SIGUSR1: ``pipeline.job.faults``) or ``--save-interval`` saves the whole training state
into ``SAVE/checkpoint``: DeepSpeed's files through ``pipeline.checkpoints.checkpoint`` (weights, optimizer,
learning-rate schedule, loss scale, every RNG stream) and, per rank, the batches' position and the losses so far.
The same command run again finds it and continues as if it had never stopped (the same batches, dropout masks and
fp32 losses); the job's settings and layout must be those it was saved with. The finished job removes it: the
classifier supersedes it.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from finetune.job.args import FinetuneError
from pipeline.checkpoints import checkpoint
from pipeline.job.loop import StepResult, barrier, is_rank0, when
from pipeline.tracking.metrics import drop_records_after

CHECKPOINT_DIR = "checkpoint"


def saved_state(save: Path | None) -> Path | None:
    """``SAVE/checkpoint`` when it holds a complete saved state of an interrupted run."""
    d = save / CHECKPOINT_DIR if save is not None else None
    return d if d is not None and d.is_dir() and checkpoint.complete_tags(d) else None


def save_state_hook(engine, save: Path | None, batches, losses: list, settings: dict, layout: dict, last: int,
                    interval: int | None):
    """The loop's hook that saves the state at a stop signal's step and every ``interval`` steps (never at the
    last step: the classifier is the output then). Collective: every rank saves its part (DeepSpeed's files, its
    batches' position and the losses so far)."""
    def due(r: StepResult) -> bool:
        return save is not None and r.step < last and (r.last or bool(interval) and r.step % interval == 0)

    def save_state(r: StepResult) -> None:
        checkpoint.save(engine, save / CHECKPOINT_DIR, r.step, layout={**layout, "finetune_settings": settings},
                        data_state={"batches": batches.state_dict(), "losses": list(losses)})

    return when(due, save_state)


def continue_interrupted(engine, save: Path | None, settings: dict, layout: dict, batches) -> tuple[int, list]:
    """(steps done, losses so far): an interrupted run's saved state loaded into the engine and the batches,
    or (0, []) for a new run."""
    state_dir = saved_state(save)
    if state_dir is None:
        return 0, []
    return restore_state(engine, state_dir, check_resumable(state_dir, settings, layout), batches)


def check_resumable(state_dir: Path, settings: dict, layout: dict) -> str:
    """The tag to continue from; refuses (one line) a state saved with other settings or at another layout."""
    tag = checkpoint.resolve_tag(state_dir)
    saved = checkpoint.saved_layout(state_dir, tag)
    then, now = saved.get("finetune_settings", {}), json.loads(json.dumps(settings))
    differ = [k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
    if differ:
        shown = "; ".join(f"{k}: {then.get(k)!r} then, {now.get(k)!r} now" for k in differ[:3])
        raise FinetuneError(f"--save {state_dir.parent} holds an interrupted run with other settings ({shown}); "
                            f"rerun its command to continue it, or pass --force to start afresh")
    if not checkpoint.same_layout(saved, layout):
        kept = ("tensor_parallel", "data_parallel", "zero_stage", "precision")
        raise FinetuneError(f"--save {state_dir.parent} holds an interrupted run saved at "
                            + ", ".join(f"{k} {saved.get(k)}" for k in kept)
                            + "; continue it at that layout (now: "
                            + ", ".join(f"{k} {layout.get(k)}" for k in kept) + ")")
    return tag


def restore_state(engine, state_dir: Path, tag: str, batches) -> tuple[int, list]:
    """The saved state loaded into the built engine and the batches; returns (step, losses so far)."""
    step, data = checkpoint.load(engine, state_dir, tag)
    batches.load_state_dict(data["batches"])
    if is_rank0():  # the log as it was at the saved step: one series (a run killed later logged steps run again)
        drop_records_after(state_dir.parent / "metrics.jsonl", step)
        print(f"note: continuing the interrupted run in {state_dir.parent} after step {step}, from its last "
              f"complete checkpoint {state_dir / tag} (--force starts it afresh)", file=sys.stderr)
    return step, list(data["losses"])


def remove_state(save: Path | None) -> None:
    """The finished job's classifier supersedes the saved state (this job's own output)."""
    barrier()
    if save is not None and is_rank0():
        shutil.rmtree(save / CHECKPOINT_DIR, ignore_errors=True)
