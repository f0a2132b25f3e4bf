"""The SFT and DPO jobs of parsed arguments (``finetune.lm.job.sft`` and ``.dpo`` parse them without loading torch):
their data, their step's forward, and the run over ``finetune.lm.job.providers``."""
from __future__ import annotations

import datasets

from finetune.lm.chat import load_conversations, tokenize_conversations, training_chat_template
from finetune.lm.dpo import tokenize_pairs
from finetune.lm.job.preference import collate as collate_pairs, provide_forward, sequence_multiple
from finetune.lm.job.providers import PostTrainingError, answer_finished, run, start
from finetune.lm.job.samples import chat_sample_hooks
from finetune.lm.packing import collate, pack_conversations
from finetune.lm.sft import sft_loss
from pipeline.data.build import main_process_first

__all__ = ["run_sft", "run_dpo", "provide_rows", "sft_forward", "sft_pipe_batch", "provide_pairs"]


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


def sft_pipe_batch(batch) -> tuple:
    """A micro-batch as the pipeline stages take it (``pipeline.engine.steps.pipeline_step``): the input ids with
    their document ids (``pipe_model.PackedRowsEmbedding``), the targets for the last stage's loss, the count of
    assistant tokens."""
    return (batch.input_ids, batch.documents.document_ids), batch.targets, {"tokens": batch.num_targets}


def run_sft(args) -> dict:
    """The SFT job; returns the last metrics."""
    finished = answer_finished(args, "sft")
    if finished is not None:
        return finished
    base, job = start(args, "SFT")
    return run(args, "sft", base, job, provide_rows(args, base),
               lambda rows: collate(rows, base.config.seq_length, base.pad_id), lambda engine: sft_forward,
               lambda engine: chat_sample_hooks(args, engine, base, job), pipe_batch=sft_pipe_batch)


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


def run_dpo(args) -> dict:
    """The DPO job; returns the last metrics."""
    finished = answer_finished(args, "dpo")
    if finished is not None:
        return finished
    base, job = start(args, "DPO", dropout=False)
    rows = provide_pairs(args, base)  # with LoRA the reference is the policy with its adapters off
    return run(args, "dpo", base, job, rows, collate_pairs(base.pad_id, sequence_multiple(job.state.layout)),
               lambda engine: provide_forward(args, base, job, engine, rows), beta=args.beta)
