"""Samples during pretraining (``--sample-interval N --sample-prompts FILE``): at every N-th step and the last,
greedy and seeded sampled continuations of the prompts go to ``samples.jsonl`` in the run and to DeepSpeed's
monitor (TensorBoard text, a W&B table), on rank 0. Every rank decodes (a TP group decodes together); the
model is put in eval mode for it (no dropout drawn) and samples from its own generator, so the training's RNG
streams, and therefore its losses, are those of a run without samples."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.generation.decode import generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.prompts import PromptError, encode_prompts, read_prompts
from pipeline.generation.sampling import SampleSettings
from pipeline.job.arguments import add_sample_args  # noqa: F401 (re-exported)
from pipeline.job.files import open_append
from pipeline.job.loop import every, is_rank0


class _RunTokenizer:
    """A run's ``pipeline.data.tokenizer.Tokenizer`` as ``encode_prompts`` reads tokenizers."""

    def __init__(self, tokenizer):
        self.encode, self.prefix, self.start_id = tokenizer.encode, [], tokenizer.eod_id


def check_sample_args(args, job, config) -> None:
    """Refused before the run starts."""
    if args.sample_interval is None:
        if args.sample_prompts is not None:
            raise PromptError("--sample-prompts without --sample-interval; pass --sample-interval N")
        return
    # (the layouts it cannot sample at are refused with the rest: pipeline.job.layout.samples_during_training)
    refusals = [(args.sample_interval < 1, f"--sample-interval must be >= 1, got {args.sample_interval}"),
                (args.sample_prompts is None, "--sample-interval needs --sample-prompts FILE")]
    reason = next((message for refused, message in refusals if refused), None)
    if reason:
        raise PromptError(f"{reason}; drop --sample-interval or change the layout")


def sample_hooks(args, engine, config, tokenizer, job, save_dir: Path | None) -> list:
    """The loop hook that writes samples (none without --sample-interval)."""
    check_sample_args(args, job, config)
    if args.sample_interval is None:
        return []
    texts = read_prompts(path=args.sample_prompts)
    model = engine.module
    ids = encode_prompts(_RunTokenizer(tokenizer), texts, decoder_for(model).max_positions, "--sample-prompts")
    path = save_dir / "samples.jsonl" if save_dir is not None and is_rank0() else None

    def sample(r) -> None:
        was_training = model.training
        model.eval()
        try:
            kinds = {"greedy": SampleSettings(args.sample_new_tokens),
                     "sampled": SampleSettings(args.sample_new_tokens, greedy=False, seed=args.seed + r.step,
                                               temperature=args.sample_temperature, top_k=args.sample_top_k)}
            out = {kind: generate(decoder_for(model), ids, s, eos_id=tokenizer.eod_id, pad_id=tokenizer.eod_id)
                   for kind, s in kinds.items()}
        finally:
            model.train(was_training)
        records = [{"step": r.step, "kind": kind, "prompt": text, "completion": tokenizer.decode(g.new_ids),
                    "new_ids": g.new_ids, "finish_reason": g.finish_reason}
                   for kind, gens in out.items() for text, g in zip(texts, gens)]
        if is_rank0():
            write_samples(path, records, engine.monitor, r.step)
    return [every(args.sample_interval, sample)]


def write_samples(path: Path | None, records: list[dict], monitor, step: int) -> None:
    """Appended to ``samples.jsonl`` (a log, flushed like metrics.jsonl) and to the monitor's text writers."""
    if path is not None:
        with open_append(path) as f:
            f.write("".join(json.dumps(rec) + "\n" for rec in records))
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        for kind in ("greedy", "sampled"):
            text = "\n\n".join(f"**{rec['prompt']}** {rec['completion']}" for rec in records if rec["kind"] == kind)
            tb.summary_writer.add_text(f"pretrain/samples_{kind}", text, step)
        tb.summary_writer.flush()
    if getattr(monitor, "wandb_monitor", None) is not None:
        import wandb  # noqa: PLC0415  (optional: only a config with a wandb section needs it)
        table = wandb.Table(columns=["step", "kind", "prompt", "completion"],
                            data=[[rec["step"], rec["kind"], rec["prompt"], rec["completion"]] for rec in records])
        monitor.wandb_monitor.log({"pretrain/samples": table, "pretrain/step": step})
