"""The pretraining job (``pipeline.pretrain`` parses its arguments): its providers, as Megatron's
``pretrain(datasets_provider, model_provider, forward_step)`` takes them — the model config and tokenizer
(``provide_model_config``), the data (``provide_data``), the engine (``provide_engine``) — and the loop with its hooks
(``run_pretraining``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.compile import compile_transformer_layers
from pipeline.checkpoints import async_save, checkpoint
from pipeline.checkpoints.resume import StartPoint, plan_start, restore
from pipeline.data import DistributedBatchLoader, StreamBatchLoader, build_pretraining_data, main_process_first
from pipeline.data.build import run_tokenizer
from pipeline.engine.build import build_engine
from pipeline.engine.schedules import schedule_from_args
from pipeline.engine.steps import lm_batches, lm_step_record, lm_validation_record, train_step
from pipeline.generation.training import sample_hooks
from pipeline.job.families import ModelFamily
from pipeline.job.loop import Job, StepResult, every, is_rank0, setup, train_loop, when
from pipeline.job.model_configs import choose_model_config, make_model_config, preview_model_config
from pipeline.job.options import EngineOptions
from pipeline.job.run_dir import RunReport, start_run
from pipeline.tracking.straggler import straggler_hook

__all__ = ["Model", "provide_model_config", "provide_data", "provide_engine", "run_pretraining"]


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


def run_pretraining(args) -> dict:
    """The job of parsed arguments (``pipeline.pretrain.parse_args``); returns the last step's metrics."""
    inputs = [("--model-config", args.model_config), ("--tokenizer", args.tokenizer),
              *(("--data", d) for d in ([args.data] if isinstance(args.data, str) else args.data or []))]
    start_run(args, inputs, "pretrain")  # resumes --save's run, protects what the user owns (docs/runs.md)
    raw_config, family = choose_model_config(args.model_config, args.model_type, Path(args.load) if args.load else None)
    job = setup(EngineOptions.from_args(args), config=preview_model_config(raw_config, args.seq_length),
                family=family, extras={"sample_interval": args.sample_interval})
    m = provide_model_config(args, raw_config, family)
    train, make_valid = provide_data(args, m, job)
    layout, save_dir = job.record(m.family.name), Path(args.save) if args.save else None
    start = plan_start(m.load_dir, args.load_tag, layout, job.ds, save_dir=save_dir)
    engine, step = provide_engine(args, m, job, start, train)
    if save_dir is not None and is_rank0():
        checkpoint.save_run_files(save_dir, m.config, m.tokenizer)
    report = RunReport(args, start.ds, engine.monitor, start_step=step, prefix="pretrain")
    batches, tokens_per_step, last = lm_batches(train), job.global_batch * m.config.seq_length, {}

    def log(r: StepResult) -> None:
        last.update(lm_step_record(engine, r, tokens_per_step=tokens_per_step, world_size=job.state.world_size,
                                   flops_per_step=m.config.flops_per_token(m.config.seq_length) * tokens_per_step,
                                   peak_tflops=args.peak_tflops))
        r.bar.set_postfix(loss=f"{r.out:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{last['tokens_per_s']:.0f}")
        report.metrics.write({k: v for k, v in last.items() if not k.startswith("valid_")})

    def evaluate(r: StepResult) -> None:
        record = lm_validation_record(engine, lm_batches(make_valid()), args.eval_iters, r.step,
                                      streams=m.family.stream_data)
        report.validation(r, record)
        last.update(record)

    saver = async_save.make_saver(engine, save_dir, layout, args.async_save)  # poll: at each step boundary
    hooks = [saver.poll, report.step,
             straggler_hook(args.straggler_interval, report.metrics, threshold=args.straggler_threshold),
             every(args.log_interval, log), *sample_hooks(args, engine, m.config, m.tokenizer, job, save_dir),
             every(args.eval_interval if make_valid is not None else None, evaluate),
             when(lambda r: save_dir is not None and (r.last or bool(args.save_interval)
                                                      and r.step % args.save_interval == 0),
                  lambda r: saver.save(r.step, train.state_dict(), last=r.last))]
    with saver:  # the end of the job waits for a write in flight
        end = train_loop(lambda: train_step(engine, batches), first=step + 1, last=args.train_steps, desc="pretrain",
                         hooks=hooks)
    report.finish(end, last, tokens_per_step)
    return last
