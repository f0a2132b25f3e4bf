"""The finetuning job itself, which ``finetune/train.py`` (the command) and ``finetune.ensemble`` (training its
members) run: base, data, head and engine from the providers, the training loop, then the thresholds, scores and
the saved classifier (``finetune.job.finish``)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from finetune.batching import TrainBatches, pooled_features, predict_encoded, predict_pooled
from finetune.job.finish import FinetuneRun, finish, finished_before, summary
from finetune.job.inputs import check_save
from finetune.job.loop import finetune_step, loop_hooks
from finetune.job.providers import (fit_ds_config, provide_base, provide_data, provide_engine, provide_head,
                                    run_settings)
from finetune.job.resume import continue_interrupted, remove_state, save_state_hook
from pipeline.job.loop import is_rank0, quiet_deepspeed, setup, train_loop
from pipeline.job.options import EngineOptions
from pipeline.job.run_dir import RunReport, say, warn_without_save


def run(args) -> dict:
    finished = finished_before(args)  # the same command again after it finished: nothing to run
    if finished is not None:
        for line in finished[0]:
            say(line)
        return finished[1]
    check_save(args)
    warn_without_save(args, "finetune", "no classifier, no metrics.jsonl")
    if not args.verbose:
        quiet_deepspeed(False)
    base = provide_base(args)
    data = provide_data(args, base)
    head = provide_head(args, base, data)
    job = setup(EngineOptions.from_args(args), config=base.config, family=base.family)
    job = fit_ds_config(args, base, data, job, torch.device(get_accelerator().current_device_name()))
    engine, schedule, steps_per_epoch, total_steps = provide_engine(args, base, data, head, job)
    inputs = _train_inputs(args, base, data, head, job, engine)

    save = Path(args.save) if args.save else None
    settings = run_settings(args, base, data, head, job, (steps_per_epoch, total_steps), inputs.cached)
    layout = job.record(base.family.name)
    done, losses = continue_interrupted(engine, save, settings, layout, inputs.batches)
    # args.json, ds_config.json, the settings to the monitor, metrics.jsonl as one series up to step `done`
    report = RunReport(args, job.ds, engine.monitor, start_step=done, prefix="finetune")
    if not done:
        report.metrics.write({"settings": settings})
    t0 = time.perf_counter()
    hooks = [*loop_hooks(args, engine, data, inputs.predict, report.metrics, schedule, steps_per_epoch,
                         job.global_batch, losses),
             save_state_hook(engine, save, inputs.batches, losses, settings, layout, total_steps, args.save_interval)]
    steps = train_loop(lambda: finetune_step(engine, inputs.batches), first=done + 1, last=total_steps,
                       desc="finetune", hooks=hooks)
    train_seconds = time.perf_counter() - t0
    if steps < total_steps:  # a stop signal ended it: its state is saved, the same command continues it
        if save is not None and is_rank0():
            print(f"rerun the same command to continue after step {steps} of {total_steps}", file=sys.stderr)
        report.end([])
        return {"stopped_after": steps, "losses": losses, "train_seconds": train_seconds}

    # thresholds, scores, predictions
    result = finish(FinetuneRun(args, base, data, head, engine, inputs.predict, save, report.metrics, settings))
    remove_state(save)
    result.update(losses=losses, train_seconds=train_seconds, feature_seconds=inputs.feature_seconds, steps=steps,
                  sequence_parallel=settings["sequence_parallel"],
                  group_lrs=[(g.get("lr_mult", 1.0), g["lr"]) for g in engine.optimizer.param_groups])
    report.end(summary(args, first=done + 1, last=steps, train_loss=losses[-1] if losses else None,
                       dev=result["dev_record"], exported=result.get("hf_export")))
    return result


@dataclass
class TrainInputs:
    batches: TrainBatches
    predict: Callable  # predict(split name, progress=False) -> probabilities
    cached: bool  # the frozen encoder's pooled features computed once
    feature_seconds: float


def _train_inputs(args, base, data, head, job, engine) -> TrainInputs:
    """The training batches and the predictor of each split (token ids, or a frozen encoder's features)."""
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

    def predict(name, progress=False):
        if cached:
            return predict_pooled(engine.module, encoded[name])
        return predict_encoded(engine.module, encoded[name], base.pad_id, batch_size=args.eval_batch_size,
                               progress=progress and is_rank0(), desc=f"predict {name}", **dp_kwargs)

    return TrainInputs(batches, predict, cached, feature_seconds)
