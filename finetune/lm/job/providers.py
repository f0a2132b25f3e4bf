"""The providers of the language-model finetuning commands (``finetune/lm/job/sft.py``, ``dpo.py``) over the
job layer: the base model and its tokenizer, LoRA, the DP-sharded resumable batches, the engine, the training
loop with its hooks (log, the state saved at a stop signal or every --save-interval steps, continued by the same
command run again at any TP x DP layout: ``finetune.lm.job.resume``; the command's own, e.g. samples), and the
exports at the end.

Outputs in --save: metrics.jsonl; checkpoint/ while the run is unfinished; at the end model/ (the project's
model directory, a base for the next command), hf/ (the Hugging Face export, adapters merged) and, with LoRA,
adapter/ (a PEFT adapter: ``PeftModel.from_pretrained(<the HF export of the base>, "adapter")``).
"""
from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig
from transformers import AutoTokenizer, PreTrainedConfig

from finetune.job.loop import full_fp32_state
from finetune.job.resume import CHECKPOINT_DIR, remove_state, save_state_hook, saved_state
from pipeline.job.layout import POST_TRAINING
from finetune.lm.job.options import lora_from_args, lora_settings
from finetune.lm.job.report import Trained, finished_before, is_finished, summary
from finetune.lm.job.resume import continue_from, plan_continuation, reuse_reference_logps
from finetune.saved import load_full_gpt_state
from models.lora import LoRAConfig, is_lora_parameter
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.data.loaders import DistributedBatchLoader
from pipeline.engine.build import build_engine
from pipeline.engine.pipe_model import lora_adder
from pipeline.engine.ds_config import precision
from pipeline.engine.schedules import schedule_from_args
from pipeline.engine.steps import grad_norm, optimizer_step, pipeline_step
from pipeline.hf.export import export_hf
from pipeline.hf.peft_adapter import (LoRATarget, export_peft_adapter, lora_targets, merged_state_dict,
                                      project_targets)
from pipeline.job.errors import UserError
from pipeline.job.families import ModelFamily, family_of
from pipeline.job.faults import LOCK_FILE
from pipeline.job.files import OutputError, contents_digest, refuse_overlap
from pipeline.job.loop import Job, StepResult, barrier, every, is_rank0, setup, train_loop
from pipeline.job.options import EngineOptions
from pipeline.job.run_dir import refuse_non_empty, save_settings, say, settings_record, warn_without_save
from pipeline.tracking.metrics import MetricsWriter


class PostTrainingError(UserError, ValueError):
    """Arguments or inputs the language-model finetuning commands cannot work with."""


@dataclass
class Base:
    """The base model provider's result."""
    family: ModelFamily
    config: object
    state: Mapping | None    # full TP=1 weights (a model directory's read lazily), until the engine holds them
    tokenizer: object         # a transformers tokenizer
    tokenizer_dir: Path
    lora: LoraConfig | None
    targets: list[LoRATarget] | None

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id


def check_save(args, inputs) -> None:
    """--save is new or empty, holds this command's interrupted run (continued), or is replaced with --force."""
    if args.save is None:
        return
    refuse_overlap(args.save, inputs, "--save")
    save = Path(args.save)
    if save.exists() and not save.is_dir():
        raise OutputError(f"--save {save}: a file; give a directory")
    if getattr(args, "no_resume", False):
        refuse_non_empty(save)
    if saved_state(save) is not None and not args.force:
        return
    if save.is_dir() and any(p.name != LOCK_FILE for p in save.iterdir()):
        if not args.force:
            finished = is_finished(save)  # (without its args.json: finished_before answers one with it)
            raise OutputError(f"--save {save}: " + ("holds a finished run (model/, hf/): nothing to run; choose a "
                                                    "new directory, or pass --force to train it again" if finished
                                                    else "not empty; choose a new directory, rerun the interrupted "
                                                         "command that wrote it, or pass --force to replace its "
                                                         "outputs"))
        shutil.rmtree(save / CHECKPOINT_DIR, ignore_errors=True)
        for log in ("metrics.jsonl", "samples.jsonl"):  # (appended to by the run)
            (save / log).unlink(missing_ok=True)


def provide_base(args, lora: LoraConfig | None, *, dropout: bool = True) -> Base:
    """The base GPT, its tokenizer and the LoRA targets (a module name that matches nothing is refused), read
    before any process group exists. ``dropout`` False: hidden and attention dropout off (TRL's DPO default)."""
    config, state, tokenizer_dir = load_full_gpt_state(args.base, lazy=True)  # read into the model tensor by tensor
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else tokenizer_dir
    if tokenizer_dir is None:
        raise PostTrainingError(f"--base {args.base}: holds no tokenizer; pass --tokenizer")
    # config: the directory's config.json is the project's, not a transformers config (transformers would warn)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False, config=PreTrainedConfig())
    if len(tokenizer) > config.vocab_size:
        raise PostTrainingError(f"--tokenizer {tokenizer_dir}: {len(tokenizer)} tokens, more than the model's "
                                f"{config.vocab_size}; give the base model's tokenizer")
    seq_length = args.seq_length or min(config.max_position_embeddings, 1024)
    if seq_length > config.max_position_embeddings:
        raise PostTrainingError(f"--seq-length {seq_length}: longer than the model's {config.max_position_embeddings}"
                                f" positions; give at most that")
    # the packed path attends through its own mask, without attention dropout (models.documents)
    drop = {"hidden_dropout": config.hidden_dropout if dropout else 0.0, "attention_dropout": 0.0}
    config = dataclasses.replace(config, seq_length=seq_length, **drop)
    targets = lora_targets(config, lora, "--lora-target-modules") if lora is not None else None
    return Base(family_of(config), config, state, tokenizer, tokenizer_dir, lora, targets)


# -- data --------------------------------------------------------------------------------------------------------------

class RowIndices:
    """Row indices as the map-style sequences of ``DistributedBatchLoader``, which deals them: its per-epoch
    permutation, DP shares and resumable position, for rows of any shape."""
    def __init__(self, n: int, name: str):
        self.n, self.name = n, name

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def row_loader(rows, job: Job, seed: int, name: str) -> DistributedBatchLoader:
    state = job.state
    try:
        return DistributedBatchLoader(RowIndices(len(rows), name), job.micro_batch, state.get_data_parallel_rank(),
                                      state.data_parallel, seed=seed)
    except ValueError as e:
        raise PostTrainingError(str(e)) from None


def row_batches(loader: DistributedBatchLoader, rows, collate: Callable):
    """The loader's micro-batches of ``rows``, collated."""
    for batch in loader:
        yield collate([rows[int(i)] for i in batch["tokens"][:, 0]])


def train_steps(args, loader: DistributedBatchLoader, job: Job) -> int:
    """--train-steps, or --epochs over the data in global batches (sets ``args.train_steps`` for the schedule)."""
    if args.epochs is not None:
        per_epoch = max(1, len(loader) * job.micro_batch * job.state.data_parallel // job.global_batch)
        args.train_steps = max(1, math.ceil(args.epochs * per_epoch))
    return args.train_steps


# -- engine ------------------------------------------------------------------------------------------------------------

def provide_engine(args, base: Base, job: Job, ds: dict | None = None):
    """The engine over the base weights; with LoRA the base frozen and adapters added (each linear's A drawn from
    --seed and its name: the same at every layout, on whichever pipeline stage holds it), so the optimizer, ZeRO's
    partitions and the universal checkpoint hold the adapters only (the base is read from --base again). ``ds``:
    the DeepSpeed config, if not the job's."""
    adapt = None if base.lora is None else lora_adder(
        base.config, project_targets(base.targets), LoRAConfig(base.lora.r, base.lora.lora_alpha,
                                                               base.lora.lora_dropout), args.seed)
    schedule = schedule_from_args(args, job.ds)
    if job.state.pipeline_parallel > 1:  # SFT's stages of packed rows (pipeline.engine.pipe_model; DPO is refused
        # there by pipeline.job.layout.post_training_layout), the base loaded into each stage's layers
        engine = build_engine(base.config, ds or job.ds, job.state, init_seed=args.seed, full_state_dict=base.state,
                              packed_rows=True, schedule=schedule, adapt=adapt)
    else:
        def builder(config, init_seed):
            model = build_in_dtype(base, config, init_seed, weights_dtype(ds or job.ds))
            load_full_state_dict(model, base.state, source=str(args.base))
            return model  # (the adapters, added by ``adapt``, drawn in fp32, then cast by DeepSpeed as the base)
        engine = build_engine(base.config, ds or job.ds, job.state, init_seed=args.seed, model_builder=builder,
                              schedule=schedule, adapt=adapt)
    return engine


def weights_dtype(ds: dict) -> torch.dtype:
    """The dtype DeepSpeed gives the module's weights under ``ds`` (bf16, fp16: it casts the module to it)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision(ds), torch.float32)


def build_in_dtype(base: Base, config, init_seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The base model built with its weights already in ``dtype``: under bf16 / fp16 the frozen base (all of LoRA's
    weights but the adapters) is never held in fp32 first. The loaded values round to ``dtype`` as DeepSpeed's cast of
    an fp32 model would round them (the GPT has no buffers; its random init is overwritten by the load)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return base.family.build(config, init_seed)
    finally:
        torch.set_default_dtype(before)


def frozen_copy(base: Base, dtype: torch.dtype, device) -> torch.nn.Module:
    """The base at this rank's shard, frozen, on ``device`` (a reference model), built in ``dtype``: a bf16 run
    never holds an fp32 copy of the base beside its own weights."""
    model = build_in_dtype(base, base.config, 0, dtype)
    load_full_state_dict(model, base.state, source="the base")
    return model.to(device=device).eval().requires_grad_(False)


# -- the loop ----------------------------------------------------------------------------------------------------------

def run_settings(args, base: Base, job: Job, **extra) -> dict:
    """What an interrupted run must be continued with (``finetune.job.resume.check_resumable``)."""
    return {"base": str(args.base), "data": str(args.data), "data_contents": contents_digest(args.data),
            "lora": lora_settings(base.lora, base.targets),
            "seq_length": base.config.seq_length,
            "train_steps": args.train_steps, "lr": args.lr, "global_batch": job.global_batch,
            "micro_batch": job.micro_batch, "seed": args.seed, **extra}


def train(args, name: str, engine, layout: dict, loader, step: Callable[[], dict], settings: dict,
          resumed: tuple[int, list], extra_hooks: list, ds: dict) -> Trained:
    """``train_loop`` over ``step()`` (one optimizer step: the loss, the tokens, what the forward returns) from
    where an interrupted run stopped (``resumed``: the steps done and their losses); logs every --log-interval steps
    to SAVE/metrics.jsonl."""
    save = Path(args.save) if args.save else None
    done, losses = resumed
    metrics = MetricsWriter(save / "metrics.jsonl" if save and is_rank0() else None, monitor=engine.monitor,
                            prefix=name)
    if not done:
        metrics.write({"settings": settings})
    metrics.log_settings(settings_record(args, ds))  # W&B's config, TensorBoard's hparams
    last: dict = {}
    timing = {"tokens": 0, "seconds": 0.0}

    def keep(r: StepResult) -> None:
        losses.append(r.out["loss"])
        timing["tokens"] += int(r.out["tokens"])
        timing["seconds"] += r.seconds

    def log(r: StepResult) -> None:
        last.clear()
        last.update({"step": r.step, **r.out, "lr": engine.get_lr()[0], "grad_norm": grad_norm(engine),
                     "step_seconds": r.seconds, "tokens_per_s": r.out["tokens"] / r.seconds})
        metrics.write(last)
        r.bar.set_postfix(loss=f"{r.out['loss']:.4f}", lr=f"{last['lr']:.2e}")

    hooks = [keep, every(args.log_interval, log),
             save_state_hook(engine, save, loader, losses, settings, layout, args.train_steps, args.save_interval),
             *extra_hooks]
    steps = train_loop(step, first=done + 1, last=args.train_steps, desc=name, hooks=hooks)
    metrics.close()
    return Trained(steps, losses, dict(last), steps >= args.train_steps, **timing)


def answer_finished(args, name: str) -> dict | None:
    """The same command again on its finished run: its summary and next commands said, its result (nothing runs);
    None when --save holds no finished run of this command (``report.finished_before``)."""
    finished = finished_before(args, name)
    if finished is None:
        return None
    lines, result = finished
    for line in lines:
        say(line)
    return result


def start(args, what: str, *, dropout: bool = True) -> tuple[Base, Job]:
    """--save checked, the base and LoRA read, then ``setup``: the layout validated with every rule (this
    command's: ``pipeline.job.layout.post_training_layout``), the process groups built."""
    check_save(args, [("--base", args.base), ("--data", args.data), ("--tokenizer", args.tokenizer)])
    warn_without_save(args, f"mds-{what.lower()}", "no checkpoint, no metrics.jsonl, no exports")
    base = provide_base(args, lora_from_args(args, args.base, task_type="CAUSAL_LM"), dropout=dropout)
    job = setup(EngineOptions.from_args(args), config=base.config, family=base.family,
                extras={POST_TRAINING: what,
                        "sample_interval": getattr(args, "sample_interval", None)})
    return base, job


def run(args, name: str, base: Base, job: Job, rows: list, collate: Callable, make_forward: Callable,
        make_hooks: Callable = lambda engine: [], pipe_batch: Callable | None = None, **settings) -> dict:
    """Batches of ``rows``, the engine (an interrupted run's state loaded into it, from any layout), the loop over
    ``make_forward(engine)``'s forward with ``make_hooks(engine)``'s hooks, then the exports (or where a stop
    signal ended the run). On pipeline stages each batch goes to them as ``pipe_batch(batch)`` gives it
    (``pipeline.engine.steps.pipeline_step``; the validator allows stages only to a command that has one)."""
    save = Path(args.save) if args.save else None
    if saved_state(save) is not None:  # (an interrupted run's precomputed reference, checked and taken back)
        reuse_reference_logps(args, save, rows)
    loader = row_loader(rows, job, args.seed, str(args.data))
    train_steps(args, loader, job)
    settings = run_settings(args, base, job, command=name, **settings)
    layout = job.record(base.family.name)
    plan = plan_continuation(save, settings, layout, base.config)
    engine = provide_engine(args, base, job, plan.ds(job.ds) if plan else None)
    if save is not None and is_rank0():
        save_settings(save, args, job.ds)
    forward = make_forward(engine)
    base.state = None  # the engine (and a reference model) hold the weights now
    resumed = continue_from(engine, plan, base.config, loader)
    batches = row_batches(loader, rows, collate)
    if engine.is_pipe:
        step = lambda: pipeline_step(engine, batches, pipe_batch, data_group=job.state.get_data_parallel_group())
    else:
        step = lambda: optimizer_step(engine, batches, forward, counts=("tokens",))
    trained = train(args, name, engine, layout, loader, step, settings, resumed, make_hooks(engine), job.ds)
    if not trained.finished:
        return {"stopped_after": trained.steps, "losses": trained.losses}
    exports = export(args, base, engine)
    for line in summary(args, name, first=resumed[0] + 1, trained=trained, exports=exports):
        say(line)
    return {"steps": trained.steps, "losses": trained.losses, **trained.last, **exports}


# -- the exports -------------------------------------------------------------------------------------------------------

def export(args, base: Base, engine) -> dict:
    """model/, hf/ and with LoRA adapter/ in --save from the fp32 master weights (collective); the paths."""
    full = full_fp32_state(engine)
    out: dict = {}
    if args.save is not None and is_rank0():
        save = Path(args.save)
        if base.lora is not None:  # the frozen base as it was read, not rounded to the engine's precision
            adapter = {k: v for k, v in full.items() if is_lora_parameter(k)}
            out["adapter"] = export_peft_adapter(save / "adapter", base.lora, adapter, base.targets, force=True)
            full = merged_state_dict(load_full_gpt_state(args.base, lazy=True)[1], adapter, base.targets,
                                     base.lora.lora_alpha / base.lora.r)
        out["model"] = write_model_dir(base.config, full, save / "model", tokenizer=base.tokenizer_dir, force=True)
        out["hf"] = export_hf(base.config, full, save / "hf", tokenizer_dir=base.tokenizer_dir, force=True)
    barrier()
    remove_state(Path(args.save) if args.save else None)
    return {k: str(v) for k, v in out.items()}
