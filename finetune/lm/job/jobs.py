"""The SFT and DPO jobs of parsed arguments (``finetune.lm.job.sft`` and ``.dpo`` parse them without loading torch):
their data, their step's forward, and the run over ``finetune.lm.job.providers``."""
from __future__ import annotations

import datasets

from finetune.lm.chat import IGNORE_INDEX, load_conversations, tokenize_conversations, training_chat_template
from finetune.lm.dpo import collate_pairs, completion_logps, dpo_loss, reference_logps, tokenize_pairs
from finetune.lm.job.providers import PostTrainingError, frozen_copy, run, start
from finetune.lm.packing import collate, pack_conversations
from finetune.lm.sft import sft_loss
from pipeline.data.build import main_process_first

__all__ = ["run_sft", "run_dpo", "provide_rows", "sft_forward", "provide_pairs", "dpo_forward"]


def provide_rows(args, base) -> list[dict]:
    """The conversations rendered (assistant-only labels) and packed into rows of --seq-length tokens."""
    template = training_chat_template(base.tokenizer, f"--tokenizer {base.tokenizer_dir}")
    with main_process_first():
        tokenized = tokenize_conversations(load_conversations(args.data), base.tokenizer, template)
        return list(pack_conversations(tokenized, base.config.seq_length))


def sft_forward(engine, batch) -> dict:
    """The mean loss over the micro-batch's assistant tokens (the packed path: ``engine.module`` itself, its
    gradients reduced by ``engine.backward``)."""
    batch = batch.to(engine.device)
    return {"loss": sft_loss(engine.module, batch), "tokens": batch.num_targets}


def run_sft(args) -> dict:
    """The SFT job; returns the last metrics."""
    base, job = start(args, "SFT")
    return run(args, "sft", base, job, provide_rows(args, base),
               lambda rows: collate(rows, base.config.seq_length, base.pad_id), lambda engine: sft_forward)


def provide_pairs(args, base) -> list[dict]:
    """The pairs tokenized (prompt, chosen and rejected ids); a pair longer than --seq-length is refused."""
    with main_process_first():
        pairs = tokenize_pairs(datasets.load_dataset("json", data_files=str(args.data), split="train"),
                               base.tokenizer)
    rows = list(pairs)
    for i, r in enumerate(rows):
        length = len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
        if length > base.config.seq_length:
            raise PostTrainingError(f"{args.data}: pair {i} has {length} tokens, more than --seq-length "
                                    f"{base.config.seq_length}; shorten it or raise --seq-length")
    return rows


def dpo_forward(beta: float, reference):
    """The step's forward: the policy's and the reference's completion log-probabilities, TRL's loss and metrics
    (``reference`` None: the policy with its adapters off)."""
    def forward(engine, batch) -> dict:
        ids, targets = (t.to(engine.device) for t in batch)
        loss, metrics = dpo_loss(completion_logps(engine, ids, targets),
                                 reference_logps(engine.module, ids, targets, reference), beta)
        return {"loss": loss, **metrics, "tokens": int((targets != IGNORE_INDEX).sum())}
    return forward


def run_dpo(args) -> dict:
    """The DPO job; returns the last metrics."""
    base, job = start(args, "DPO", dropout=False)

    def make_forward(engine):  # with LoRA the reference is the policy with its adapters off
        return dpo_forward(args.beta, frozen_copy(base, engine) if base.lora is None else None)

    return run(args, "dpo", base, job, provide_pairs(args, base), lambda rows: collate_pairs(rows, base.pad_id),
               make_forward, beta=args.beta)
