"""An interrupted SFT / DPO run continued by its command at the layout it was saved at (``finetune.job.resume``)
or at another one: the saved state goes through DeepSpeed's universal checkpoint (``pipeline.checkpoints.universal``,
written inside SAVE/checkpoint, removed with it), which carries the weights, Adam's moments and step and the
learning-rate schedule to the new TP x DP layout; the batches continue from the saved position and the losses so
far are kept. RNG streams start afresh (they belong to the old layout's ranks). A move the universal checkpoint
cannot make (``universal.unsupported_reason``) is refused in one line, as before. A DPO run that precomputed its
reference's log-probabilities continues with those it stored (SAVE/reference_logps.jsonl), not a second reference
pass, and only on the same pairs."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets

from finetune.job.resume import check_resumable, restore_state, saved_state
from finetune.lm.dpo import REFERENCE_FIELDS
from pipeline.checkpoints import checkpoint, safe_load, universal
from pipeline.data.build import main_process_first
from pipeline.job.errors import UserError
from pipeline.job.files import atomic_write_json
from pipeline.job.loop import is_rank0
from pipeline.tracking.metrics import drop_records_after


REFERENCE_FILE = "reference_logps.jsonl"  # where a DPO run stores its reference's log-probabilities (preference.py)


class ChangedDataError(UserError, ValueError):
    """An interrupted run continued on other data than it started with."""


@dataclass(frozen=True)
class Continuation:
    """Where an interrupted run continues from; ``cache``: its universal checkpoint (another layout)."""
    state_dir: Path
    tag: str
    cache: Path | None

    def ds(self, ds: dict) -> dict:
        """The DeepSpeed config the engine is built with (a universal load needs it said)."""
        return universal.enable(ds) if self.cache is not None else ds


def plan_continuation(save: Path | None, settings: dict, layout: dict, config) -> Continuation | None:
    """Collective. None for a new run; the saved state's tag (and at another layout its universal checkpoint,
    converted now) for an interrupted one, whose settings must be the same. ``config``: the model's."""
    state_dir = saved_state(save)
    if state_dir is None:
        return None
    tag = checkpoint.resolve_tag(state_dir)
    saved = checkpoint.saved_layout(state_dir, tag)
    if checkpoint.same_layout(saved, layout) or universal.unsupported_reason(saved, layout) is not None:
        return Continuation(state_dir, check_resumable(state_dir, settings, layout), None)  # (refuses the latter)
    check_resumable(state_dir, settings, saved)  # the settings only
    if is_rank0():
        print(f"note: continuing the interrupted run in {state_dir.parent} (saved at "
              f"{checkpoint.layout_text(saved)}) at {checkpoint.layout_text(layout)}: through a universal "
              f"checkpoint", file=sys.stderr)
        atomic_write_json(state_dir / "config.json", config.to_dict())  # what the conversion reads the model from
    return Continuation(state_dir, tag, universal.prepare(state_dir, tag, saved, layout, cache_root=state_dir))


def continue_from(engine, plan: Continuation | None, config, batches) -> tuple[int, list]:
    """Collective. (steps done, losses so far): the saved state loaded into the engine and the batches, or
    (0, []) for a new run."""
    if plan is None:
        return 0, []
    if plan.cache is None:
        return restore_state(engine, plan.state_dir, plan.tag, batches)
    universal.load(engine, plan.cache, config)
    step, _ = checkpoint.restore_after_reshard(engine, plan.state_dir, plan.tag)  # the step, the LR schedule
    data = safe_load.safe_torch_load(plan.state_dir / plan.tag / "rank0_state.pt")["data"]  # (layout-free)
    batches.load_state_dict(data["batches"])
    if is_rank0():
        drop_records_after(plan.state_dir.parent / "metrics.jsonl", step)
    return step, list(data["losses"])


def reuse_reference_logps(args, save: Path, rows: list[dict]) -> None:
    """An interrupted DPO run of --precompute-ref-log-probs: ``rows`` (the tokenized pairs of --data) take the
    reference log-probabilities it stored in SAVE/reference_logps.jsonl before its first step (so the command makes
    no reference pass, and keeps the file), after --data is checked to hold the same pairs (refused otherwise).
    Nothing for another run, or pairs that came with their own."""
    stored_file = save / REFERENCE_FILE
    if not getattr(args, "precompute_ref_log_probs", False) or REFERENCE_FIELDS[0] in rows[0] \
            or not stored_file.is_file():
        return
    stored = [json.loads(line) for line in stored_file.read_text().splitlines()]
    with main_process_first():  # (datasets' cache, written once)
        given = datasets.load_dataset("json", data_files=str(args.data), split="train")  # as the file was written
    differ = next((i for i, (pair, kept) in enumerate(zip(given, stored))
                   if pair != {k: v for k, v in kept.items() if k not in REFERENCE_FIELDS}), None)
    if differ is not None or len(given) != len(stored) or len(rows) != len(stored):
        where = f"line {differ + 1} differs from {stored_file}" if differ is not None else \
            f"{len(given)} pairs, {len(stored)} in {stored_file}"
        raise ChangedDataError(f"--data {args.data}: not the pairs the interrupted run in {save} started with "
                               f"({where}); continue it with its own data, or pass --force to start afresh")
    for row, kept in zip(rows, stored):
        row.update({f: kept[f] for f in REFERENCE_FIELDS})
    if is_rank0():
        print(f"note: the reference's log-probabilities of {stored_file} (computed before the interruption) are "
              f"used again: no reference pass", file=sys.stderr)
