"""The finetuning loop's step (the classifier's losses over one global batch), its hooks (log, dev scores)
and the full fp32 weights gathered over TP at the end.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_fp32_param

from finetune.job.providers import Splits
from finetune.scoring.metrics import evaluate_probabilities, single_label_scores
from models.moe import gather_experts
from models.parallel import gather_full, get_shard_spec
from pipeline.engine.steps import optimizer_step
from pipeline.job.loop import StepResult, every

# ------------------------------------------------------------------------------------------- training

def classifier_forward(engine, batch) -> dict:
    """The losses of one micro-batch (token ids, or the pooled features of a frozen encoder)."""
    dev = engine.device
    if "pooled" in batch:
        parts = engine(None, batch["labels"].to(dev), pooled=batch["pooled"].to(dev), return_parts=True)
    else:
        parts = engine(batch["input_ids"].to(dev), batch["labels"].to(dev), lengths=batch["lengths"].to(dev),
                       return_parts=True)
    return {**parts, "tokens": batch["lengths"].sum() if "lengths" in batch else 0}


def finetune_step(engine, batches) -> dict:
    """One optimizer step over all micro-batches of the global batch; mean losses over them and over DP
    (tokens: summed)."""
    out = optimizer_step(engine, batches, classifier_forward, counts=("tokens",))
    out["tokens"] = int(out["tokens"])
    return out


def full_fp32_state(engine) -> dict[str, torch.Tensor]:
    """The model's full TP=1, EP=1 state dict from the fp32 master weights (collective over all ranks); of a
    pipeline engine the whole model's under the GPT's names, on its pipeline's first stage (empty elsewhere)."""

    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p) if p.requires_grad else None
        value = (master if master is not None else p.detach()).float()
        out[name] = gather_full(value, get_shard_spec(p)).cpu()
    out = gather_experts(out, engine.module)
    return _stages_state(engine, out) if getattr(engine, "is_pipe", False) else out


def _stages_state(engine, stage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's weights, renamed as the GPT names them, gathered on the first stage. A tied embedding's
    last-stage copy (its position table never trained there) gives way to the first stage's."""
    grid = engine.grid
    first = grid.stage_to_global(0)
    parts = [None] * grid.get_pipe_parallel_world_size() if dist.get_rank() == first else None
    dist.gather_object({engine.param_display_name(k): v for k, v in stage.items()}, parts, dst=first,
                       group=grid.get_pipe_parallel_group())
    full: dict[str, torch.Tensor] = {}
    for part in parts or ():
        for name, value in part.items():
            full.setdefault(name, value)
    return full


def loop_hooks(args, engine, data: Splits, predict, metrics, schedule, steps_per_epoch: int, global_batch: int,
               losses: list) -> list:
    """The training loop's hooks: keep each loss, log every --log-interval steps, score dev every
    --eval-interval steps (default each epoch; the end of the job scores it anyway)."""
    window = {"tokens": 0, "seconds": 0.0}

    def keep(r: StepResult) -> None:
        losses.append(r.out["loss"])
        window["tokens"] += r.out["tokens"]
        window["seconds"] += r.seconds

    def log(r: StepResult) -> None:
        norm_ = engine.get_global_grad_norm()
        full_window = r.step % args.log_interval == 0
        record = {"step": r.step, "epoch": r.step / steps_per_epoch,
                  **{k: v for k, v in r.out.items() if k != "tokens"},
                  "lr": schedule(r.step - 1), "grad_norm": None if norm_ is None else float(norm_),
                  "tokens_per_s": window["tokens"] / window["seconds"],
                  "examples_per_s": global_batch * args.log_interval / window["seconds"] if full_window else None}
        metrics.write(record)
        r.bar.set_postfix(loss=f"{r.out['loss']:.4f}", lr=f"{record['lr']:.2e}")
        window.update(tokens=0, seconds=0.0)

    def evaluate(r: StepResult) -> None:
        scores = dev_scores(data, predict("dev"))
        metrics.write({"step": r.step, "epoch": r.step / steps_per_epoch, **scores})
        r.bar.write(f"step {r.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    return [keep, every(args.log_interval, log), every(args.eval_interval or steps_per_epoch, evaluate, at_last=False)]


def dev_scores(data: Splits, probs) -> dict:
    dev = data.dev
    loss = {"dev_loss": dev_loss(data, probs)}
    if data.multilabel:
        s = evaluate_probabilities(dev.labels, probs, dev.label_names)["at_0.5"]
        return {**loss, "dev_micro_f1": s["micro_f1"], "dev_macro_f1": s["macro_f1"], "dev_jaccard": s["jaccard"]}
    s = single_label_scores(dev.class_indices(), probs.argmax(1), dev.label_names)
    return {**loss, "dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"]}


def dev_loss(data: Splits, probs) -> float:
    """Dev's loss from its probabilities: the mean binary cross-entropy over texts and labels (multilabel) or the
    cross-entropy of the true class, without the training loss's extras (positive weights, label correlation,
    the auxiliary LM loss)."""
    p = torch.as_tensor(probs, dtype=torch.float64)
    if data.multilabel:
        return float(F.binary_cross_entropy(p, torch.as_tensor(data.dev.labels, dtype=torch.float64)))
    log_p = p.clamp_min(torch.finfo(torch.float64).tiny).log()
    return float(F.nll_loss(log_p, torch.as_tensor(data.dev.class_indices(), dtype=torch.long)))
