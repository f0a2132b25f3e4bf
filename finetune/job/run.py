"""The finetuning job itself, which ``finetune/train.py`` (the command) and ``finetune.ensemble`` (training its
members) run: base, data, head and engine from the providers, the training loop, then the thresholds, scores and
the saved classifier (``finetune.job.finish``)."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from finetune.batching import TrainBatches, pooled_features, predict_encoded, predict_pooled
from finetune.job.finish import FinetuneRun, finish
from finetune.job.inputs import check_save
from finetune.job.loop import finetune_step, loop_hooks
from finetune.job.providers import (fit_ds_config, provide_base, provide_data, provide_engine, provide_head,
                                    run_settings)
from pipeline.job.loop import apply_sequence_parallel, is_rank0, quiet_deepspeed, setup, train_loop
from pipeline.job.options import EngineOptions
from pipeline.tracking.metrics import MetricsWriter


def run(args) -> dict:
    check_save(args)
    if not args.verbose:
        quiet_deepspeed(False)
    base = provide_base(args)
    data = provide_data(args, base)
    head = provide_head(args, base, data)
    job = setup(EngineOptions.from_args(args))
    apply_sequence_parallel(base.config, job)
    job = fit_ds_config(args, base, data, job, torch.device(get_accelerator().current_device_name()))
    engine, schedule, steps_per_epoch, total_steps = provide_engine(args, base, data, head, job)
    state = job.state
    dp_kwargs = dict(dp_rank=state.get_data_parallel_rank(), dp_world_size=state.data_parallel,
                     dp_group=state.get_data_parallel_group())
    cached = args.freeze_encoder and head.config.pooling != "attention"
    encoded = data.encoded
    t_features = time.perf_counter()
    if cached:  # a frozen encoder gives the same features every epoch: compute them once
        encoded = {name: pooled_features(engine.module, ids, base.pad_id, batch_size=args.eval_batch_size,
                                         progress=is_rank0(), desc=f"features {name}", **dp_kwargs)
                   for name, ids in encoded.items()}
    feature_seconds = time.perf_counter() - t_features if cached else 0.0
    batches = TrainBatches(encoded["train"], data.train.labels, job.micro_batch, state.get_data_parallel_rank(),
                           state.data_parallel, base.pad_id, seed=args.seed, group_by_length=args.group_by_length,
                           global_batch_size=job.global_batch)

    save = Path(args.save) if args.save else None
    metrics = MetricsWriter(save / "metrics.jsonl" if save and is_rank0() else None, monitor=engine.monitor,
                            prefix="finetune")
    settings = run_settings(args, base, data, head, job, (steps_per_epoch, total_steps), cached)
    metrics.write({"settings": settings})

    def predict(name, progress=False):
        if cached:
            return predict_pooled(engine.module, encoded[name])
        return predict_encoded(engine.module, encoded[name], base.pad_id, batch_size=args.eval_batch_size,
                               progress=progress and is_rank0(), desc=f"predict {name}", **dp_kwargs)

    losses, t0 = [], time.perf_counter()
    hooks = loop_hooks(args, engine, data, predict, metrics, schedule, steps_per_epoch, job.global_batch, losses)
    steps = train_loop(lambda: finetune_step(engine, batches), first=1, last=total_steps, desc="finetune",
                       hooks=hooks)  # fewer than total_steps when a stop signal ended it
    train_seconds = time.perf_counter() - t0

    # thresholds, scores, predictions
    result = finish(FinetuneRun(args, base, data, head, engine, predict, save, metrics, settings))
    result.update(losses=losses, train_seconds=train_seconds, feature_seconds=feature_seconds, steps=steps,
                  sequence_parallel=settings["sequence_parallel"],
                  group_lrs=[(g.get("lr_mult", 1.0), g["lr"]) for g in engine.optimizer.param_groups])
    metrics.close()
    return result
