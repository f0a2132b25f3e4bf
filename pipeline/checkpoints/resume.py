"""Where a training run starts from: a run directory resumed at its own layout (DeepSpeed's load), at another
layout (a universal checkpoint, or the full weights re-cut where DeepSpeed has none), or a model directory's
weights (e.g. an imported Hugging Face model) that a new run starts from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import checkpoint, universal


@dataclass
class StartPoint:
    """What the engine is built with (``ds``, ``full_state``) and what is restored into it afterwards."""
    load_dir: Path | None
    resume: bool
    ds: dict
    tag: str | None = None
    cache: Path | None = None  # the universal checkpoint that carries the optimizer state to this layout
    full_state: dict | None = None  # full weights the engine is built from (another layout without universal)


def plan_start(load_dir: Path | None, tag: str | None, layout: dict, ds: dict) -> StartPoint:
    if load_dir is None:
        return StartPoint(None, False, ds)
    if not checkpoint.is_deepspeed_run_dir(load_dir):  # weights only: a new run starts from them
        _, full_state, _ = checkpoint.read_full_checkpoint(load_dir)
        return StartPoint(load_dir, False, ds, full_state=full_state)
    tag = checkpoint.resolve_tag(load_dir, tag)
    saved = checkpoint.saved_layout(load_dir, tag)
    start = StartPoint(load_dir, True, ds, tag)
    if saved.get("universal_only") or not checkpoint.same_layout(saved, layout):
        reason = universal.has_experts(load_dir) and universal.moe_unsupported_reason(saved, layout)
        if reason:  # refused, not resumed with the optimizer state restarted: that path is untested for experts
            raise checkpoint.CheckpointError(f"--load {load_dir} ({tag}): {reason}; resume it at the layout it was "
                                             f"saved at ({checkpoint.layout_text(saved)})")
        start.cache = universal.prepare(load_dir, tag, saved, layout)
        if start.cache is not None:
            start.ds = universal.enable(ds)
        else:
            _, start.full_state, _ = checkpoint.read_full_model_state(load_dir, tag)
    return start


def restore(engine, start: StartPoint, model_config, loader) -> int:
    """Restores a resumed run into the built engine and the data loader; returns the step it continues after."""
    if not start.resume:
        return 0
    if start.cache is not None:
        universal.load(engine, start.cache, model_config)
        step, data_state = checkpoint.restore_after_reshard(engine, start.load_dir, start.tag)
    elif start.full_state is None:
        step, data_state = checkpoint.load(engine, start.load_dir, start.tag)
    else:
        step, data_state = checkpoint.restore_after_reshard(engine, start.load_dir, start.tag)
    if data_state is not None:
        try:
            loader.load_state_dict(data_state)
        except ValueError as e:  # the loader's own words say what differs
            raise checkpoint.CheckpointError(
                f"--load {start.load_dir} ({start.tag}): {e}; resume with the --data, --seq-length, tokenizer and "
                f"--seed the run was trained with, or start a new run from its weights with a new --save") from None
    return step
