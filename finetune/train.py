"""The finetuning job: a text classifier (multilabel emotions, or single-label) on a pretrained project model.

    deepspeed --num_gpus N finetune/train.py --base runs/gpt2 --train E-c-train.tsv --dev E-c-dev.tsv \
        --deepspeed_config ds_configs/bf16_zero1.json --tensor-parallel 2 --global-batch-size 32 \
        --epochs 3 --lr 3e-5 --save runs/ec [--test E-c-test.tsv] [--labels plutchik]

Also runs under ``torchrun`` and as ``python -m finetune.train`` (one process). ``--base`` is a pretraining
run of this project (a GPT saved at any TP/PP layout, or an mLSTM), a ``config.json`` + ``model.safetensors``
directory (e.g. an imported Hugging Face model) or a finetuned classifier. Texts are tokenised with the base
model's tokenizer. The GPT runs at any tensor-parallel size (pipeline parallelism is not used for finetuning);
the mLSTM is data-parallel only and classifies from its final cell state.

Writes into ``--save``: the classifier (classifier.json, model.safetensors as a full TP=1 state dict,
thresholds.json tuned on dev or on a held-out part of train, tokenizer/), metrics.jsonl, eval.json (scores at
0.5 and at the tuned thresholds), per_class_f1.png, predictions in the official E-c format
(dev_predictions.txt, test_predictions.txt) and, when the head is one Hugging Face can hold, the exported
``transformers`` classifier in hf/.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun: the project root, not finetune/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from deepspeed.accelerator import get_accelerator

from finetune.batching import TrainBatches, pooled_features, predict_encoded, predict_pooled
from finetune.job.args import parse_args
from finetune.job.finish import FinetuneRun, finish
from finetune.job.inputs import check_save
from finetune.job.loop import finetune_step, loop_hooks
from finetune.job.providers import (fit_ds_config, provide_base, provide_data, provide_engine, provide_head,
                                    run_settings)
from pipeline.job.errors import command, console_script
from pipeline.job.loop import apply_sequence_parallel, is_rank0, quiet_deepspeed, setup, train_loop
from pipeline.job.options import EngineOptions
from pipeline.tracking.metrics import MetricsWriter


@command
def main(argv=None) -> dict:
    """Run the job; a bad argument or input is one line ``error: <what and where>`` and exit code 2."""
    return run(parse_args(argv))


# ------------------------------------------------------------------------------------------------ the job

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


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    main()
