"""The pretraining main job.

    deepspeed --num_gpus N pipeline/pretrain.py --model-config gpt2-125m --deepspeed_config ds_configs/bf16_zero2.json \
        --tensor-parallel 2 --pipeline-parallel 1 --data "corpus/*.txt" --tokenizer path/to/gpt2 \
        --train-steps 1000 --save runs/gpt2 [--load runs/gpt2]

Also runs under ``torchrun``, as ``python -m pipeline.pretrain`` and ``mds-pretrain``; DP is what TP x CP x PP leave.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun: the project root, not pipeline/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from models.compile import compile_transformer_layers
from pipeline.checkpoints import checkpoint, recovery_script
from pipeline.checkpoints.resume import StartPoint, plan_start, restore
from pipeline.data import DistributedBatchLoader, StreamBatchLoader, build_pretraining_data, main_process_first
from pipeline.data.build import run_tokenizer
from pipeline.data.options import add_data_args
from pipeline.engine.build import build_engine
from pipeline.engine.schedules import add_lr_args, schedule_from_args
from pipeline.engine.steps import lm_batches, lm_step_record, lm_validation_record, train_step
from pipeline.generation.training import add_sample_args, sample_hooks
from pipeline.job.errors import ArgumentParser, command, console_script
from pipeline.job.families import ModelFamily
from pipeline.job.loop import Job, StepResult, every, is_rank0, setup, train_loop, when
from pipeline.job.model_configs import (add_model_args, check_recompute_args, choose_model_config, make_model_config,
                                        preview_model_config)
from pipeline.job.options import EngineOptions, add_checkpoint_args, add_engine_args, add_run_args, default_ds_config
from pipeline.tracking.metrics import MetricsWriter
from pipeline.tracking.straggler import add_straggler_args, straggler_hook

__all__ = ["main", "parse_args", "default_ds_config"]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    add_model_args(p)
    add_engine_args(p)
    add_data_args(p)
    add_lr_args(p)
    add_run_args(p, add_checkpoint_args(p))
    add_sample_args(p)
    add_straggler_args(p)
    return check_recompute_args(p.parse_args(argv))


@dataclass
class Model:
    """What the model provider gives the loop."""
    family: ModelFamily
    config: object
    tokenizer: object
    load_dir: Path | None


def provide_model_config(args, raw_config: dict, family: ModelFamily) -> Model:
    """The model config and the tokenizer (a resumed run keeps the one it trained with)."""
    load_dir = Path(args.load) if args.load else None
    tokenizer = run_tokenizer(load_dir, args.tokenizer, family.default_tokenizer, corpus=args.data,
                              vocab_size=args.vocab_size)
    return Model(family, make_model_config(raw_config, tokenizer.vocab_size, args.seq_length), tokenizer, load_dir)


def provide_data(args, m: Model, job: Job):
    """(train loader, a function that makes a fresh validation loader or None)."""
    with main_process_first():
        train, valid = build_pretraining_data(args.data, m.tokenizer, m.config.seq_length, text_field=args.text_field,
                                              valid_fraction=args.valid_fraction, seed=args.seed,
                                              streaming=args.streaming, num_proc=args.num_proc,
                                              cache_dir=args.cache_dir, weights=args.data_weights,
                                              encoding_errors=args.data_encoding_errors)
    dp_rank, dp, micro = job.state.get_data_parallel_rank(), job.state.data_parallel, job.micro_batch
    if m.family.stream_data:  # contiguous streams: each row continues where the previous batch stopped
        def loader(data, shuffle=True):
            return StreamBatchLoader(data, micro, m.config.seq_length, dp_rank, dp, seed=args.seed)
    else:
        def loader(data, shuffle=True):
            return DistributedBatchLoader(data, micro, dp_rank, dp, seed=args.seed, shuffle=shuffle)
    return loader(train), (None if valid is None else lambda: loader(valid, shuffle=False))


def provide_engine(args, m: Model, job: Job, start: StartPoint, loader):
    """The DeepSpeed engine, built and restored from ``start``; returns (engine, first step - 1)."""
    builder = m.family.build_for_training if job.state.pipeline_parallel == 1 else None
    engine = build_engine(m.config, start.ds, job.state, init_seed=args.seed, schedule=schedule_from_args(args, job.ds),
                          full_state_dict=start.full_state, model_builder=builder)
    step = restore(engine, start, m.config, loader)
    if job.layout.compile:  # each transformer block on its own; DeepSpeed's hooks stay eager (models/compile.py)
        compile_transformer_layers(engine.module)
    return engine, step


def main(argv=None) -> dict:
    """The job (a user error raises; run as a command, ``pipeline.job.errors.command`` reports it in one line)."""
    args = parse_args(argv)
    inputs = [("--model-config", args.model_config), ("--tokenizer", args.tokenizer),
              *(("--data", d) for d in ([args.data] if isinstance(args.data, str) else args.data or []))]
    checkpoint.check_save_dir(args.save, load=args.load, inputs=inputs)  # nothing the user owns is replaced
    raw_config, family = choose_model_config(args.model_config, args.model_type, Path(args.load) if args.load else None)
    job = setup(EngineOptions.from_args(args), config=preview_model_config(raw_config, args.seq_length),
                family=family, extras={"sample_interval": args.sample_interval})
    m = provide_model_config(args, raw_config, family)
    train, make_valid = provide_data(args, m, job)
    layout = job.record(m.family.name)
    engine, step = provide_engine(args, m, job, plan_start(m.load_dir, args.load_tag, layout, job.ds), train)
    save_dir = Path(args.save) if args.save else None
    if save_dir is not None and is_rank0():
        checkpoint.save_run_files(save_dir, m.config, m.tokenizer)
    metrics = MetricsWriter(save_dir / "metrics.jsonl" if save_dir and is_rank0() else None,
                            monitor=engine.monitor, prefix="pretrain")
    batches, tokens_per_step, last = lm_batches(train), job.global_batch * m.config.seq_length, {}

    def log(r: StepResult) -> None:
        last.clear()
        last.update(lm_step_record(engine, r, tokens_per_step=tokens_per_step, world_size=job.state.world_size,
                                   flops_per_step=m.config.flops_per_token(m.config.seq_length) * tokens_per_step,
                                   peak_tflops=args.peak_tflops))
        r.bar.set_postfix(loss=f"{r.out:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{last['tokens_per_s']:.0f}")
        metrics.write(last)

    def evaluate(r: StepResult) -> None:
        record = lm_validation_record(engine, lm_batches(make_valid()), args.eval_iters, r.step,
                                      streams=m.family.stream_data)
        metrics.write(record)
        last.update(record)

    def save(r: StepResult) -> None:
        recovery_script.install(checkpoint.save(engine, save_dir, r.step, data_state=train.state_dict(), layout=layout))

    hooks = [straggler_hook(args.straggler_interval, metrics, threshold=args.straggler_threshold),  # every rank
             every(args.log_interval, log), *sample_hooks(args, engine, m.config, m.tokenizer, job, save_dir),
             every(args.eval_interval if make_valid is not None else None, evaluate),
             when(lambda r: save_dir is not None and (r.last or bool(args.save_interval)
                                                      and r.step % args.save_interval == 0), save)]
    train_loop(lambda: train_step(engine, batches), first=step + 1, last=args.train_steps, desc="pretrain",
               hooks=hooks)
    metrics.close()
    return last


cli = console_script(main)  # the console script (pyproject.toml)

if __name__ == "__main__":
    command(main)()
