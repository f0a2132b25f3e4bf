"""The pretraining main job.

    deepspeed --num_gpus N pipeline/pretrain.py --model-config gpt2-125m --deepspeed_config ds_configs/bf16_zero2.json \
        --tensor-parallel 2 --pipeline-parallel 1 --data "corpus/*.txt" --tokenizer path/to/gpt2 \
        --train-steps 1000 --save runs/gpt2 [--load runs/gpt2]

Also runs under ``torchrun`` and as ``python -m pipeline.pretrain`` (one process).
The data-parallel size is what is left of the world size after TP x PP.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import ConfigError
from pipeline.checkpoints import checkpoint, universal
from pipeline.data import (DistributedBatchLoader, StreamBatchLoader, build_pretraining_data, check_same_tokenizer,
                           load_saved_tokenizer, load_tokenizer, main_process_first)
from pipeline.engine.ds_config import EngineConfigError, precision, zero_stage
from pipeline.engine.build import build_engine
from pipeline.engine.steps import eval_loss, lm_batches, loss_scale, train_step
from pipeline.job.errors import ArgumentParser, UserError, command
from pipeline.job.families import ModelFamily, family_named, family_of_dict
from pipeline.job.options import EngineOptions, add_engine_args, add_run_args, default_ds_config
from pipeline.job.loop import Job, StepResult, apply_sequence_parallel, every, is_rank0, setup, train_loop, when
from pipeline.tracking.metrics import MetricsWriter
from pipeline.engine.schedules import LRSchedule, scaled_lr

PRESETS = Path(__file__).resolve().parents[1] / "models" / "configs"
__all__ = ["main", "parse_args", "default_ds_config"]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=["gpt", "mlstm"], default=None,
                   help="gpt (default) or mlstm (the character-level multiplicative LSTM, trained by truncated "
                        "BPTT on contiguous byte streams; default: the model config's model_type)")
    g.add_argument("--model-config", default=None,
                   help=f"a JSON file, or a preset name from {PRESETS.name}/ ({', '.join(presets())}); default: "
                        f"the checkpoint's config with --load, else gpt2-tiny")
    g.add_argument("--seq-length", type=int, help="training sequence length (default: the config's seq_length)")
    g.add_argument("--activation-checkpointing", action="store_true")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (DeepSpeed's engine.compile(); pipeline-parallel 1 only); "
                        "bench/train_step.py --systems deepspeed,deepspeed+compile measures what it gains")
    add_engine_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", default=None,
                   help="a corpus: files, folders, globs, save_to_disk dirs, hub names; repeat or comma-separate "
                        "to concatenate (default: the Python standard library's source, real text on every machine)")
    g.add_argument("--data-weights", help="comma-separated mixture weights, one per --data source")
    g.add_argument("--data-encoding-errors", choices=["strict", "replace", "ignore"], default="strict",
                   help="bytes that are not UTF-8: refuse the file (strict, default), or read them as U+FFFD "
                        "(replace) or drop them (ignore)")
    g.add_argument("--text-field", default="text")
    g.add_argument("--streaming", action="store_true")
    g.add_argument("--tokenizer", default=None,
                   help="'bytes', 'train-bpe', a tokenizer.json, or a directory with vocab.json + merges.txt "
                        "(default: the checkpoint's when resuming, else train-bpe)")
    g.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of --tokenizer train-bpe")
    g.add_argument("--valid-fraction", type=float, default=0.01)
    g.add_argument("--num-proc", type=int, default=1, help="processes for tokenization")
    g.add_argument("--cache-dir", default=None, help="datasets cache directory")
    g = p.add_argument_group("optimization")
    g.add_argument("--train-steps", type=int, default=100)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the DS config's optimizer lr)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-steps", type=int, default=None, help="default: 1%% of --train-steps")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--lr-scale-base-batch", type=int, default=None,
                   help="large-batch recipe: the lr is --lr x global batch / this batch, capped at --lr-max")
    g.add_argument("--lr-max", type=float, default=None, help="cap of the batch-scaled learning rate")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="directory for checkpoints and metrics.jsonl")
    g.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (default: at the end)")
    g.add_argument("--load", default=None,
                   help="resume from this run directory's latest complete checkpoint (any TP/PP/DP layout), or "
                        "start from the weights of a config.json + model.safetensors directory (pipeline.import_hf)")
    g.add_argument("--load-tag", default=None, help="resume from this tag (e.g. global_step200) instead of latest")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak TFLOP/s for MFU (no MFU without it; 989 for H100/H200 dense bf16)")
    add_run_args(p, g)
    return p.parse_args(argv)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def read_model_config(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file() and (PRESETS / f"{spec}.json").is_file():
        path = PRESETS / f"{spec}.json"
    if not path.is_file():
        raise ConfigError(f"model config {spec!r} is neither a file nor a preset ({', '.join(presets())})")
    return {"_source": str(path), **json.loads(path.read_text())}


def make_model_config(raw: dict, vocab_size: int, seq_length: int | None):
    """The family's config class (by the config's model_type), its vocabulary following the tokenizer."""
    raw = dict(raw)
    source = raw.pop("_source", "model config")
    family = family_of_dict(raw, source)
    if raw.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"{source}: vocab_size {raw['vocab_size']} differs from the tokenizer's {vocab_size}; "
                          f"drop vocab_size from the config (it follows the tokenizer) or use the matching tokenizer")
    raw["vocab_size"] = vocab_size
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return family.config_class.from_dict(raw, source=source)


# -- the providers: model config and tokenizer, data, model ------------------------------------------------------------

@dataclass
class Model:
    """What the model provider gives the loop."""
    family: ModelFamily
    config: object
    tokenizer: object
    load_dir: Path | None
    resume: bool


def provide_model_config(args) -> Model:
    """The model config and the tokenizer (a resumed run keeps the one it trained with)."""
    load_dir = Path(args.load) if args.load else None
    if args.model_config is None:
        args.model_config = (str(load_dir / "config.json") if load_dir is not None else
                             family_named(args.model_type or "gpt").default_preset)
    raw_config = read_model_config(args.model_config)
    family = family_of_dict(raw_config, raw_config["_source"])
    if args.model_type is not None and args.model_type != family.name:
        raise UserError(f"--model-type {args.model_type} but {raw_config['_source']} is a {family.name} config; "
                        f"drop --model-type or choose another config")
    resume = load_dir is not None and checkpoint.is_deepspeed_run_dir(load_dir)
    saved_tokenizer = None
    if load_dir is not None:
        saved_tokenizer = load_dir / "tokenizer" if (load_dir / "tokenizer").is_dir() else load_dir
    if saved_tokenizer is not None and args.tokenizer is None:
        tokenizer = load_saved_tokenizer(saved_tokenizer)
    else:
        with main_process_first():
            tokenizer = load_tokenizer(args.tokenizer or family.default_tokenizer, corpus=args.data,
                                       vocab_size=args.vocab_size)
        if saved_tokenizer is not None:
            check_same_tokenizer(saved_tokenizer, tokenizer)
    config = make_model_config(raw_config, tokenizer.vocab_size, args.seq_length)
    return Model(family, config, tokenizer, load_dir, resume)


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


def lr_schedule(args, ds: dict) -> LRSchedule | None:
    base_lr = args.lr or ds.get("optimizer", {}).get("params", {}).get("lr", 3e-4)
    if args.lr_scale_base_batch:
        base_lr = scaled_lr(base_lr, ds["train_batch_size"], args.lr_scale_base_batch, args.lr_max)
    warmup = args.lr_warmup_steps if args.lr_warmup_steps is not None else max(1, args.train_steps // 100)
    return None if "scheduler" in ds else LRSchedule(base_lr, warmup, args.train_steps, args.lr_decay_style,
                                                     args.min_lr)


def provide_engine(args, m: Model, job: Job, layout: dict, loader):
    """The DeepSpeed engine, resumed (same layout: DeepSpeed's own load; another layout: a universal
    checkpoint, or the full weights re-cut where DeepSpeed has none) or started from imported weights;
    returns (engine, first step)."""
    full_state, tag, cache, ds = None, None, None, job.ds
    if m.resume:
        tag = checkpoint.resolve_tag(m.load_dir, args.load_tag)
        saved = checkpoint.saved_layout(m.load_dir, tag)
        if saved.get("universal_only") or not checkpoint.same_layout(saved, layout):
            # another layout: the optimizer state moves through a universal checkpoint where DeepSpeed can
            cache = universal.prepare(m.load_dir, tag, saved, layout)
            if cache is not None:
                ds = universal.enable(ds)
            else:
                _, full_state, _ = checkpoint.read_full_model_state(m.load_dir, tag)
    elif m.load_dir is not None:  # weights only (e.g. an imported Hugging Face model): a new run starts from them
        _, full_state, _ = checkpoint.read_full_checkpoint(m.load_dir)
    builder = m.family.build_for_training if job.state.pipeline_parallel == 1 else None
    engine = build_engine(m.config, ds, job.state, init_seed=args.seed, schedule=lr_schedule(args, job.ds),
                          activation_checkpointing=args.activation_checkpointing, full_state_dict=full_state,
                          model_builder=builder)
    step = 0
    if m.resume:
        if cache is not None:
            universal.load(engine, cache, m.config)
            step, data_state = checkpoint.restore_after_reshard(engine, m.load_dir, tag)
        elif full_state is None:
            step, data_state = checkpoint.load(engine, m.load_dir, tag)
        else:
            step, data_state = checkpoint.restore_after_reshard(engine, m.load_dir, tag)
        if data_state is not None:
            loader.load_state_dict(data_state)
    if args.compile:
        engine.compile()
    return engine, step


# -- the job -----------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    """The job (a user error raises; run as a command, ``pipeline.job.errors.command`` reports it in one line)."""
    args = parse_args(argv)
    if args.compile and args.pipeline_parallel > 1:
        raise EngineConfigError("--compile is for pipeline-parallel 1 only (DeepSpeed's pipeline engine runs its "
                                "stages layer by layer); drop --compile or use --pipeline-parallel 1")
    job = setup(EngineOptions.from_args(args))
    m = provide_model_config(args)
    m.family.check_layout(m.config, job.state.tensor_parallel, job.state.pipeline_parallel)
    apply_sequence_parallel(m.config, job)
    train, make_valid = provide_data(args, m, job)
    layout = {"tensor_parallel": job.state.tensor_parallel, "pipeline_parallel": job.state.pipeline_parallel,
              "data_parallel": job.state.data_parallel, "model_type": m.family.name, "precision": precision(job.ds),
              "sequence_parallel": job.options.sequence_parallel, "zero_stage": zero_stage(job.ds),
              "universal_info": True}
    engine, step = provide_engine(args, m, job, layout, train)
    save_dir = Path(args.save) if args.save else None
    if save_dir is not None and is_rank0():
        checkpoint.save_run_files(save_dir, m.config, m.tokenizer)
    metrics = MetricsWriter(save_dir / "metrics.jsonl" if save_dir and is_rank0() else None,
                            monitor=engine.monitor, prefix="pretrain")
    batches = lm_batches(train)
    peak_tflops = args.peak_tflops
    tokens_per_step = job.global_batch * m.config.seq_length
    flops_per_step = m.config.flops_per_token(m.config.seq_length) * tokens_per_step
    last = {}

    def log(r: StepResult) -> None:
        tflops = flops_per_step / r.seconds / job.state.world_size / 1e12
        last.clear()
        last.update({"step": r.step, "loss": r.out, "lr": engine.get_lr()[0], "loss_scale": loss_scale(engine),
                     "grad_norm": _grad_norm(engine), "skipped_steps": int(engine.skipped_steps),
                     "tokens_per_s": tokens_per_step / r.seconds, "tflops_per_device": tflops,
                     "mfu": tflops / peak_tflops if peak_tflops else None, "step_seconds": r.seconds})
        r.bar.set_postfix(loss=f"{r.out:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{last['tokens_per_s']:.0f}")
        metrics.write(last)

    def evaluate(r: StepResult) -> None:
        if m.family.stream_data:
            with engine.module.isolated_state(carry=True):  # the training streams' state survives
                val = eval_loss(engine, lm_batches(make_valid()), args.eval_iters)
            record = {"step": r.step, "valid_loss": val, "valid_bpc": val / math.log(2)}
        else:
            val = eval_loss(engine, lm_batches(make_valid()), args.eval_iters)
            record = {"step": r.step, "valid_loss": val, "valid_perplexity": math.exp(min(val, 700.0))}
        metrics.write(record)
        last.update(record)

    def save(r: StepResult) -> None:
        checkpoint.save(engine, save_dir, r.step, data_state=train.state_dict(), layout=layout)

    hooks = [every(args.log_interval, log),
             every(args.eval_interval if make_valid is not None else None, evaluate),
             when(lambda r: save_dir is not None and (r.last or bool(args.save_interval)
                                                      and r.step % args.save_interval == 0), save)]
    train_loop(lambda: train_step(engine, batches), first=step + 1, last=args.train_steps, desc="pretrain",
               hooks=hooks)
    metrics.close()
    return last


def _grad_norm(engine):
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


if __name__ == "__main__":
    command(main)()
