"""The DPO command's reference and step: the frozen base live at every step, or its log-probabilities computed
once before training (``--precompute-ref-log-probs``, TRL's ``precompute_ref_log_probs``) or handed in with the
pairs (TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns). Precomputed, no reference model stays in
memory while the policy trains; the run writes the pairs with their two columns to SAVE/reference_logps.jsonl,
a ``--data`` that a later run takes without the reference pass."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch.distributed as dist

from finetune.lm.chat import IGNORE_INDEX
from finetune.lm.dpo import (REFERENCE_FIELDS, collate_pairs, completion_logps, dpo_loss, precompute_reference_logps,
                             reference_logps, stored_reference_logps)
from finetune.lm.job.providers import Base, frozen_copy
from finetune.lm.job.resume import REFERENCE_FILE
from pipeline.job.files import atomic_write_text
from pipeline.job.loop import Job, barrier, is_rank0


def sequence_multiple(layout) -> int:
    """What the model's input length must be a multiple of: the ranks sequence and context parallelism split it
    over."""
    return (layout.tensor if layout.sequence_parallel else 1) * layout.context


def collate(pad_id: int, multiple: int = 1):
    """Batches ``(input_ids, targets, reference logps or None)`` of the tokenized pairs, the model's input a
    ``multiple`` of tokens long (``collate_pairs``)."""
    def batch(rows: list[dict]):
        return (*collate_pairs(rows, pad_id, multiple), stored_reference_logps(rows))
    return batch


def dpo_forward(beta: float, reference):
    """The step's forward: the policy's completion log-probabilities against the batch's precomputed reference
    ones, or else ``reference``'s (None: the policy with its adapters off); TRL's loss and metrics."""
    def forward(engine, batch) -> dict:
        ids, targets, stored = (t.to(engine.device) if t is not None else None for t in batch)
        policy = completion_logps(engine, ids, targets)
        ref = (stored.to(policy.dtype) if stored is not None
               else reference_logps(engine.module, ids, targets, reference))
        loss, metrics = dpo_loss(policy, ref, beta)
        return {"loss": loss, **metrics, "tokens": int((targets != IGNORE_INDEX).sum())}
    return forward


def provide_forward(args, base: Base, job: Job, engine, rows: list[dict]):
    """The forward of a run; with --precompute-ref-log-probs the reference's pass first (it fills ``rows``, which
    the batches read), and no reference model afterwards. Pairs that came with the columns need neither."""
    stored = REFERENCE_FIELDS[0] in rows[0]
    if stored or not args.precompute_ref_log_probs:
        return dpo_forward(args.beta, None if stored or base.lora is not None else _reference(base, engine))
    reference = None if base.lora is not None else _reference(base, engine)  # with LoRA: the adapters off
    rows[:] = _precomputed(rows, job, engine, reference, base.pad_id)
    del reference
    if args.save is not None and is_rank0():
        write_reference_file(Path(args.save) / REFERENCE_FILE, args.data, rows)
    barrier()
    return dpo_forward(args.beta, None)


def _reference(base: Base, engine):
    """The frozen reference in the engine's weights' dtype and on its device."""
    return frozen_copy(base, next(engine.module.parameters()).dtype, engine.device)


def _precomputed(rows: list[dict], job: Job, engine, reference, pad_id: int) -> list[dict]:
    """Every pair with its reference columns: each data-parallel rank computes every dp-th pair (its TP group
    together), then all of them are gathered."""
    state = job.state
    dp, rank = state.data_parallel, state.get_data_parallel_rank()
    mine = precompute_reference_logps(engine.module, rows[rank::dp], job.micro_batch, pad_id, reference,
                                      engine.device, sequence_multiple(state.layout))
    if dp == 1:
        return mine
    shares: list = [None] * dp
    dist.all_gather_object(shares, mine, group=state.get_data_parallel_group())
    return [shares[i % dp][i // dp] for i in range(len(rows))]


def write_reference_file(path: Path, data, rows: list[dict]) -> None:
    """The pairs of ``data`` as they were given, each with its reference columns (TRL's names)."""
    pairs = datasets.load_dataset("json", data_files=str(data), split="train")
    atomic_write_text(path, "".join(json.dumps({**pair, **{f: row[f] for f in REFERENCE_FIELDS}}) + "\n"
                                    for pair, row in zip(pairs, rows)))
