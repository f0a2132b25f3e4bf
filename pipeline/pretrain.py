"""The pretraining main job.

    deepspeed --num_gpus N pipeline/pretrain.py --model-config gpt2-125m --deepspeed_config ds_configs/bf16_zero2.json \
        --tensor-parallel 2 --pipeline-parallel 1 --data "corpus/*.txt" --tokenizer path/to/gpt2 \
        --train-steps 1000 --save runs/gpt2 [--load runs/gpt2]

Also runs under ``torchrun`` and as ``python -m pipeline.pretrain`` (one process).
The data-parallel size is what is left of the world size after TP x PP.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the deepspeed launcher or torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

PRESETS = Path(__file__).resolve().parents[1] / "models" / "configs"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    g = p.add_argument_group("parallelism and engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="DeepSpeed JSON config (default: ds_configs/cpu.json without a GPU, bf16_zero1.json with)")
    g.add_argument("--tensor-parallel", type=int, default=1)
    g.add_argument("--pipeline-parallel", type=int, default=1)
    g.add_argument("--micro-batch-size", type=int, help="overrides train_micro_batch_size_per_gpu")
    g.add_argument("--global-batch-size", type=int, help="overrides train_batch_size")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", default=None,
                   help="a corpus: files, folders, globs, save_to_disk dirs, hub names; repeat or comma-separate "
                        "to concatenate (default: the Python standard library's source, real text on every machine)")
    g.add_argument("--data-weights", help="comma-separated mixture weights, one per --data source")
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
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="directory for checkpoints and metrics.jsonl")
    g.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (default: at the end)")
    g.add_argument("--load", default=None,
                   help="resume from this run directory's latest complete checkpoint (any TP/PP/DP layout), or "
                        "start from the weights of a config.json + model.safetensors directory (pipeline.import_hf)")
    g.add_argument("--load-tag", default=None, help="resume from this tag (e.g. global_step200) instead of latest")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak TFLOP/s for MFU (default: the DS config's peak_tflops)")
    g.add_argument("--verbose", action="store_true", help="DeepSpeed's INFO logs")
    return p.parse_args(argv)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def read_model_config(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file() and (PRESETS / f"{spec}.json").is_file():
        path = PRESETS / f"{spec}.json"
    if not path.is_file():
        from models import ConfigError
        raise ConfigError(f"model config {spec!r} is neither a file nor a preset ({', '.join(presets())})")
    return {"_source": str(path), **json.loads(path.read_text())}


def make_model_config(raw: dict, vocab_size: int, seq_length: int | None):
    """GPTConfig or MLSTMConfig (by the config's model_type), its vocabulary following the tokenizer."""
    from models import ConfigError, GPTConfig, MLSTMConfig
    raw = dict(raw)
    source = raw.pop("_source", "model config")
    cls = MLSTMConfig if raw.get("model_type") == "mlstm" else GPTConfig
    if raw.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"{source}: vocab_size {raw['vocab_size']} differs from the tokenizer's {vocab_size}; "
                          f"drop vocab_size from the config (it follows the tokenizer) or use the matching tokenizer")
    raw["vocab_size"] = vocab_size
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return cls.from_dict(raw, source=source)


def model_type_of(config) -> str:
    return getattr(config, "model_type", "gpt")


def build_mlstm(config, init_seed: int):
    """The mLSTM keeps its TBPTT state between calls, so the engine's forward stays (inputs, labels)."""
    from models import MLSTM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = MLSTM(config)
    model.carry_state = True
    return model


def default_ds_config() -> str:
    root = Path(__file__).resolve().parents[1] / "ds_configs"
    return str(root / ("bf16_zero1.json" if torch.cuda.is_available() else "cpu.json"))


def is_rank0() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.verbose:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
    from models.parallel import initialize_model_parallel, model_parallel_seed
    from pipeline import checkpoint, universal
    from pipeline.data import (DistributedBatchLoader, StreamBatchLoader, build_pretraining_data,
                               check_same_tokenizer, load_saved_tokenizer, load_tokenizer, main_process_first)
    from pipeline.distributed import init_distributed
    from pipeline.engine import (build_engine, eval_loss, lm_batches, load_ds_config, loss_scale, precision,
                                 resolve_ds_config, train_step, zero_stage)
    from pipeline.metrics import MetricsWriter, StepTimer
    from pipeline.schedules import LRSchedule, scaled_lr

    if args.compile and args.pipeline_parallel > 1:
        from pipeline.engine import EngineConfigError
        raise EngineConfigError("--compile is for pipeline-parallel 1 only (DeepSpeed's pipeline engine runs its "
                                "stages layer by layer); drop --compile or use --pipeline-parallel 1")
    init_distributed()
    state = initialize_model_parallel(args.tensor_parallel, args.pipeline_parallel)
    model_parallel_seed(args.seed)
    ds = load_ds_config(args.deepspeed_config or default_ds_config())
    peak_tflops = args.peak_tflops or ds.pop("peak_tflops", None)
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, pipeline_parallel=state.pipeline_parallel,
                           micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                           source=args.deepspeed_config or default_ds_config())

    load_dir = Path(args.load) if args.load else None
    if args.model_config is None:
        args.model_config = (str(load_dir / "config.json") if load_dir is not None else
                             "mlstm-tiny" if args.model_type == "mlstm" else "gpt2-tiny")
    raw_config = read_model_config(args.model_config)
    if args.model_type is not None and args.model_type != raw_config.get("model_type", "gpt"):
        raise SystemExit(f"error: --model-type {args.model_type} but {raw_config['_source']} is a "
                         f"{raw_config.get('model_type', 'gpt')} config")
    byte_level = raw_config.get("model_type") == "mlstm"

    # tokenizer: a resumed run keeps the one it trained with
    resume = load_dir is not None and checkpoint.is_deepspeed_run_dir(load_dir)
    if load_dir is not None:
        saved_tokenizer = load_dir / "tokenizer" if (load_dir / "tokenizer").is_dir() else load_dir
    if load_dir is not None and args.tokenizer is None:
        tokenizer = load_saved_tokenizer(saved_tokenizer)
    else:
        with main_process_first():
            tokenizer = load_tokenizer(args.tokenizer or ("bytes" if byte_level else "train-bpe"), corpus=args.data,
                                       vocab_size=args.vocab_size)
        if load_dir is not None:
            check_same_tokenizer(saved_tokenizer, tokenizer)
    config = make_model_config(raw_config, tokenizer.vocab_size, args.seq_length)
    model_type = model_type_of(config)
    if model_type == "mlstm":
        if state.tensor_parallel * state.pipeline_parallel != 1:
            raise SystemExit("error: the mLSTM trains with data parallelism (and ZeRO) only: use "
                             "--tensor-parallel 1 --pipeline-parallel 1")
    else:
        config.check_parallel(state.tensor_parallel, state.pipeline_parallel)

    with main_process_first():
        train, valid = build_pretraining_data(args.data, tokenizer, config.seq_length, text_field=args.text_field,
                                              valid_fraction=args.valid_fraction, seed=args.seed,
                                              streaming=args.streaming, num_proc=args.num_proc,
                                              cache_dir=args.cache_dir, weights=args.data_weights)
    micro = ds["train_micro_batch_size_per_gpu"]
    dp_rank, dp = state.get_data_parallel_rank(), state.data_parallel
    if model_type == "mlstm":  # contiguous streams: each row continues where the previous batch stopped
        loader = StreamBatchLoader(train, micro, config.seq_length, dp_rank, dp, seed=args.seed)
    else:
        loader = DistributedBatchLoader(train, micro, dp_rank, dp, seed=args.seed)

    base_lr = args.lr or ds.get("optimizer", {}).get("params", {}).get("lr", 3e-4)
    if args.lr_scale_base_batch:
        base_lr = scaled_lr(base_lr, ds["train_batch_size"], args.lr_scale_base_batch, args.lr_max)
    warmup = args.lr_warmup_steps if args.lr_warmup_steps is not None else max(1, args.train_steps // 100)
    schedule = None if "scheduler" in ds else LRSchedule(base_lr, warmup, args.train_steps, args.lr_decay_style,
                                                         args.min_lr)
    layout = {"tensor_parallel": state.tensor_parallel, "pipeline_parallel": state.pipeline_parallel,
              "data_parallel": dp, "model_type": model_type, "precision": precision(ds), "zero_stage": zero_stage(ds),
              "universal_info": True}
    full_state, tag, universal_cache = None, None, None
    if resume:
        tag = checkpoint.resolve_tag(load_dir, args.load_tag)
        saved = checkpoint.saved_layout(load_dir, tag)
        if saved.get("universal_only") or not checkpoint.same_layout(saved, layout):
            # another layout: the optimizer state moves through a universal checkpoint where DeepSpeed can
            universal_cache = universal.prepare(load_dir, tag, saved, layout)
            if universal_cache is not None:
                ds = universal.enable(ds)
            else:
                _, full_state, _ = checkpoint.read_full_model_state(load_dir, tag)
    elif load_dir is not None:  # weights only (e.g. an imported Hugging Face model): a new run starts from them
        _, full_state, _ = checkpoint.read_full_checkpoint(load_dir)
    engine = build_engine(config, ds, state, init_seed=args.seed, schedule=schedule,
                          activation_checkpointing=args.activation_checkpointing, full_state_dict=full_state,
                          model_builder=build_mlstm if model_type == "mlstm" else None)

    step = 0
    if resume:
        if universal_cache is not None:
            universal.load(engine, universal_cache, config)
            step, data_state = checkpoint.restore_after_reshard(engine, load_dir, tag)
        elif full_state is None:
            step, data_state = checkpoint.load(engine, load_dir, tag)
        else:
            step, data_state = checkpoint.restore_after_reshard(engine, load_dir, tag)
        if data_state is not None:
            loader.load_state_dict(data_state)
    if args.compile:
        engine.compile()
    save_dir = Path(args.save) if args.save else None
    if save_dir is not None and is_rank0():
        checkpoint.save_run_files(save_dir, config, tokenizer)

    tokens_per_step = ds["train_batch_size"] * config.seq_length
    flops_per_step = config.flops_per_token(config.seq_length) * tokens_per_step
    metrics = MetricsWriter(save_dir / "metrics.jsonl" if save_dir and is_rank0() else None)
    batches = lm_batches(loader)
    timer = StepTimer()
    last = {}
    from tqdm import tqdm
    bar = tqdm(total=args.train_steps, initial=step, desc="pretrain", disable=not is_rank0(), dynamic_ncols=True)
    while step < args.train_steps:
        timer.start()
        loss = train_step(engine, batches)
        seconds = timer.stop()
        step += 1
        bar.update(1)
        if step % args.log_interval == 0 or step == args.train_steps:
            tflops = flops_per_step / seconds / state.world_size / 1e12
            last = {"step": step, "loss": loss, "lr": engine.get_lr()[0], "loss_scale": loss_scale(engine),
                    "grad_norm": _grad_norm(engine), "skipped_steps": int(engine.skipped_steps),
                    "tokens_per_s": tokens_per_step / seconds, "tflops_per_device": tflops,
                    "mfu": tflops / peak_tflops if peak_tflops else None, "step_seconds": seconds}
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{last['tokens_per_s']:.0f}")
            metrics.write(last)
        if args.eval_interval and valid is not None and (step % args.eval_interval == 0 or step == args.train_steps):
            if model_type == "mlstm":
                valid_loader = StreamBatchLoader(valid, micro, config.seq_length, dp_rank, dp, seed=args.seed)
                with engine.module.isolated_state(carry=True):  # the training streams' state survives
                    val = eval_loss(engine, lm_batches(valid_loader), args.eval_iters)
                record = {"step": step, "valid_loss": val, "valid_bpc": val / math.log(2)}
            else:
                valid_loader = DistributedBatchLoader(valid, micro, dp_rank, dp, seed=args.seed, shuffle=False)
                val = eval_loss(engine, lm_batches(valid_loader), args.eval_iters)
                record = {"step": step, "valid_loss": val}
            metrics.write(record)
            last.update(record)
        if save_dir is not None and (step == args.train_steps or (args.save_interval and step % args.save_interval == 0)):
            checkpoint.save(engine, save_dir, step, data_state=loader.state_dict(), layout=layout)
    bar.close()
    metrics.close()
    return last


def _grad_norm(engine):
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


if __name__ == "__main__":
    main()
