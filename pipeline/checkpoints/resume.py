"""Where a training run starts from: a run directory resumed at its own layout (DeepSpeed's load), at another
layout (a universal checkpoint, or the full weights re-cut where DeepSpeed has none), or a model directory's
weights (e.g. an imported Hugging Face model) that a new run starts from.

A resume at another layout says in one line what is converted and where: the universal checkpoint is written into
the run being written (``--save``), never into a run the command only reads, unless there is no --save."""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from pathlib import Path

from deepspeed.checkpoint import ds_to_universal

from models.parallel import Layout
from pipeline.checkpoints import checkpoint, universal
from pipeline.job.errors import is_rank0
from pipeline.job.layout import MOE_RUN_RESUMED_FROM, LayoutCheck, validate


@dataclass
class StartPoint:
    """What the engine is built with (``ds``, ``full_state``) and what is restored into it afterwards."""
    load_dir: Path | None
    resume: bool
    ds: dict
    tag: str | None = None
    cache: Path | None = None  # the universal checkpoint that carries the optimizer state to this layout
    full_state: dict | None = None  # full weights the engine is built from (another layout without universal)


def plan_start(load_dir: Path | None, tag: str | None, layout: dict, ds: dict, *,
               save_dir: Path | None = None) -> StartPoint:
    """Where the run starts; ``save_dir``: the run being written, which holds a universal conversion."""
    if load_dir is None:
        return StartPoint(None, False, ds)
    if not checkpoint.is_deepspeed_run_dir(load_dir):  # weights only: a new run starts from them
        _, full_state, _ = checkpoint.read_full_checkpoint(load_dir)
        return StartPoint(load_dir, False, ds, full_state=full_state)
    tag = checkpoint.resolve_tag(load_dir, tag)
    saved = checkpoint.saved_layout(load_dir, tag)
    start = StartPoint(load_dir, True, ds, tag)
    if saved.get("universal_only") or not checkpoint.same_layout(saved, layout):
        if universal.has_experts(load_dir):  # the one validator's rule for a run with experts that moves
            validate(LayoutCheck(Layout.from_record(layout), source=f"--load {load_dir} ({tag})",
                                 extras={MOE_RUN_RESUMED_FROM: universal.saved_layout_of(saved)}))
        # a cache the loaded run holds already (pipeline.reshard writes runs that have only theirs) is read there;
        # a new conversion goes into the run being written
        cache_root = load_dir if universal.cache_path(load_dir, tag).is_dir() else (save_dir or load_dir)
        if universal.unsupported_reason(saved, layout) is None and is_rank0():
            cache = universal.cache_path(cache_root, tag)
            print(f"resuming {load_dir} {tag} (saved at {checkpoint.layout_text(saved)}) at "
                  f"{checkpoint.layout_text(layout)}: its optimizer state goes through the universal checkpoint "
                  f"{cache} ({'reused' if cache.is_dir() else 'converted now'})", flush=True)
        with _labelled_conversion_bars():
            start.cache = universal.prepare(load_dir, tag, saved, layout, cache_root=cache_root)
        if start.cache is not None:
            start.ds = universal.enable(ds)
        else:
            _, start.full_state, _ = checkpoint.read_full_model_state(load_dir, tag)
    return start


@contextlib.contextmanager
def _labelled_conversion_bars():
    """DeepSpeed's ds_to_universal shows two bare progress bars: named here after what each one does."""
    module = ds_to_universal.tqdm
    labels = iter(("universal checkpoint: extract each rank's ZeRO shards",
                   "universal checkpoint: merge the shards of each parameter"))
    ds_to_universal.tqdm = types.SimpleNamespace(
        tqdm=lambda items, **kw: module.tqdm(items, **{"desc": next(labels, "universal checkpoint"), **kw}))
    try:
        yield
    finally:
        ds_to_universal.tqdm = module


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
    note = getattr(engine.lr_scheduler, "note", None)  # engine.schedules.Scheduler: the saved LR schedule's fate
    if note and is_rank0():
        print(note, flush=True)
    if data_state is not None:
        try:
            loader.load_state_dict(data_state)
        except ValueError as e:  # the loader's own words say what differs
            raise checkpoint.CheckpointError(
                f"--load {start.load_dir} ({start.tag}): {e}; resume with the --data, --seq-length, tokenizer and "
                f"--seed the run was trained with, or start a new run from its weights with a new --save") from None
    return step
