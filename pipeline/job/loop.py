"""The job layer: what every training command shares, so that a command only says what model, what data, what step.

    p = ArgumentParser(...)            # the project's: one-line errors, --debug
    add_engine_args(p)                 # --deepspeed_config, --tensor-parallel, [--pipeline-parallel],
                                       # --sequence-parallel, batch sizes
    add_run_args(p)                    # --seed, --log-interval, --verbose (ArgumentParser adds --debug)
    args = p.parse_args(argv)
    job = setup(EngineOptions.from_args(args))   # process groups, parallel state and seeds, the DeepSpeed config
    engine = build_engine(config, job.ds, job.state, ...)
    train_loop(lambda: train_step(engine, batches), first=1, last=steps, desc="pretrain",
               hooks=[every(args.log_interval, log), every(args.eval_interval, evaluate)])

Errors: raise a ``pipeline.job.errors.UserError`` subclass and decorate ``main`` with ``command``; outputs go
through ``pipeline.job.files``. In the spirit of Megatron's ``pretrain(datasets_provider, model_provider,
forward_step)``: ``pipeline/pretrain.py`` and ``finetune/train.py`` are providers over this.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from deepspeed.utils import logger as ds_logger
from tqdm import tqdm

from models.parallel import ParallelState, initialize_model_parallel, model_parallel_seed
from pipeline.engine.distributed import init_distributed
from pipeline.engine.ds_config import (EngineConfigError, check_context_parallel_options, context_parallel_ds_config,
                                       load_ds_config, precision, resolve_ds_config, sequence_parallel_ds_config,
                                       zero_stage)
from pipeline.tracking.metrics import StepTimer, place_monitor_outputs
from pipeline.job import faults
from pipeline.job.options import EngineOptions, default_ds_config


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclass
class Job:
    """What ``setup`` made: the parallel layout and the resolved DeepSpeed config."""
    options: EngineOptions
    state: ParallelState
    ds: dict
    ds_source: str

    @property
    def micro_batch(self) -> int:
        return self.ds["train_micro_batch_size_per_gpu"]

    @property
    def global_batch(self) -> int:
        return self.ds["train_batch_size"]

    def layout(self, model_type: str) -> dict:
        """What a checkpoint records of the run's layout (``checkpoint.same_layout`` compares it on resume)."""
        return {"tensor_parallel": self.state.tensor_parallel, "pipeline_parallel": self.state.pipeline_parallel,
                "data_parallel": self.state.data_parallel, "model_type": model_type, "precision": precision(self.ds),
                "sequence_parallel": self.options.sequence_parallel, "zero_stage": zero_stage(self.ds),
                "context_parallel": self.state.context_parallel, "expert_parallel": self.options.expert_parallel,
                "universal_info": True}


def quiet_deepspeed(verbose: bool) -> None:
    ds_logger.setLevel(logging.INFO if verbose else logging.WARNING)


def setup(options: EngineOptions) -> Job:
    """Join the process group, build the (TP, PP, DP) state, seed every rank, load and resolve the DeepSpeed config
    (DeepSpeed's keys only: ``resolve_ds_config`` refuses others, e.g. ``peak_tflops``, now ``--peak-tflops``)."""
    if options.sequence_parallel and options.tensor_parallel == 1:
        raise EngineConfigError("--sequence-parallel splits the sequence across the tensor-parallel ranks and does "
                                "nothing with --tensor-parallel 1; drop it or use --tensor-parallel 2 or more")
    check_context_parallel_options(options)
    if not options.verbose:
        quiet_deepspeed(False)
    init_distributed(timeout_minutes=options.distributed_timeout_minutes)
    state = initialize_model_parallel(options.tensor_parallel, options.pipeline_parallel, options.context_parallel)
    model_parallel_seed(options.seed)
    source = options.deepspeed_config or default_ds_config()
    ds = load_ds_config(source)
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, pipeline_parallel=state.pipeline_parallel,
                           micro_batch_size=options.micro_batch_size, global_batch_size=options.global_batch_size,
                           source=source)
    if options.sequence_parallel:
        sequence_parallel_ds_config(ds, state, source)  # its refusals, before any work
    if state.context_parallel > 1:
        context_parallel_ds_config(ds, source)  # its refusals, before any work
    faults.configure(options.save, exit_signal_handler=options.exit_signal_handler,
                     max_bad_steps=options.max_bad_steps, fp16=precision(ds) == "fp16")
    ds = place_monitor_outputs(ds, Path(options.save) if options.save else None)
    return Job(options, state, ds, source)


def apply_sequence_parallel(config, job: Job) -> None:
    """Switch the model config to sequence parallelism when the job asks for it, and check the layout again
    (the sequence length must divide by TP, and by CP (x TP) under context parallelism, the heads by TP x CP).
    Call after the family's ``check_layout``, which refuses the
    models that have no tensor parallelism at all."""
    if job.options.sequence_parallel:
        config.sequence_parallel = True
        config.check_parallel(job.state.tensor_parallel, job.state.pipeline_parallel)
    if job.state.context_parallel > 1:  # the sequence and the heads must split into C (docs/long_context.md)
        if not hasattr(config, "check_context_parallel"):
            raise EngineConfigError(f"--context-parallel {job.state.context_parallel}: context parallelism splits "
                                    f"the sequence of attention models (the GPT variants), not of "
                                    f"{type(config).__name__}; drop --context-parallel")
        config.check_context_parallel(job.state.tensor_parallel, job.state.context_parallel)
    apply_tiling(config, job.options)
    apply_expert_parallel(config, job)


def apply_expert_parallel(config, job: Job) -> None:
    """``--expert-parallel`` into the model config (a layout setting, not saved with the model), refused where
    DeepSpeed-MoE cannot split the experts: E must divide the data-parallel size and the number of experts, and
    DeepSpeed 0.19 has no ZeRO-3 for MoE parameters."""
    ep, experts = job.options.expert_parallel, getattr(config, "num_experts", 0)
    if ep < 1:
        raise EngineConfigError(f"--expert-parallel {ep}: the expert-parallel size must be 1 or more")
    if ep > 1 and not experts:
        raise EngineConfigError(f"--expert-parallel {ep}: the model has no experts (num_experts 0); drop "
                                f"--expert-parallel or set num_experts in the model config")
    if experts and experts % ep:
        raise EngineConfigError(f"--expert-parallel {ep} does not divide num_experts {experts}; choose a divisor "
                                f"of it")
    if ep > 1 and job.state.data_parallel % ep:
        raise EngineConfigError(f"--expert-parallel {ep} does not divide the data-parallel size "
                                f"{job.state.data_parallel}; choose a divisor of it (world = TP x PP x CP x DP)")
    if experts and zero_stage(job.ds) == 3:
        raise EngineConfigError(f"{job.ds_source}: zero_optimization.stage 3 with MoE layers: DeepSpeed 0.19 "
                                f"partitions no expert parameters under ZeRO-3; use stage 1 or 2")
    if experts:
        config.moe_expert_parallel = ep


def apply_tiling(config, options: EngineOptions) -> None:
    """``--tiled-mlp`` / ``--tiled-loss`` into the model config (a layout setting, not saved with the model)."""
    for flag, name in (("--tiled-mlp", "tiled_mlp"), ("--tiled-loss", "tiled_loss")):
        tiles = getattr(options, name)
        if tiles < 1:
            raise EngineConfigError(f"{flag} {tiles}: the number of sequence tiles must be 1 or more")
        if tiles > 1 and not hasattr(config, name):
            raise EngineConfigError(f"{flag} {tiles}: tiling is for the GPT models, not {type(config).__name__}; "
                                    f"drop {flag}")
        if tiles > 1:
            setattr(config, name, tiles)
    if getattr(config, "tiled_mlp", 1) > 1 and getattr(config, "sequence_parallel", False):
        raise EngineConfigError("--tiled-mlp with --sequence-parallel: DeepSpeed's TiledMLP recomputes its tiles as "
                                "rows of [batch x sequence], which a sequence-parallel MLP (gathered along the "
                                "sequence) cannot take; drop one of them (--tiled-loss composes with both)")


# -- the training loop -------------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    """What a hook sees after each optimizer step."""
    step: int
    out: Any  # what the step function returned
    seconds: float
    last: bool
    bar: Any


Hook = Callable[[StepResult], None]


def every(interval: int | None, hook: Hook, *, at_last: bool = True) -> Hook:
    """``hook`` on every ``interval``-th step (never when ``interval`` is falsy), and on the last step if
    ``at_last`` (else not on the last step: e.g. an evaluation that the end of the job does anyway)."""
    return when(lambda r: bool(interval) and (r.step % interval == 0 if not r.last else at_last), hook)


def when(predicate: Callable[[StepResult], bool], hook: Hook) -> Hook:
    return lambda r: hook(r) if predicate(r) else None


def train_loop(step_fn: Callable[[], Any], *, first: int, last: int, desc: str,
               hooks: Sequence[Hook] = ()) -> int:
    """Steps ``first`` .. ``last`` of ``step_fn`` (one optimizer step each), timed, with a progress bar on rank 0;
    after each step every hook runs, in order. Returns the last step run.

    The run's ``faults.Guard`` is asked after each step (every rank agrees): a stop signal makes that step the
    last (``StepResult.last``: the save hooks write a complete checkpoint) and ends the loop; a step with a
    non-finite loss runs no hook (nothing of its state is saved), and too many of them raise
    ``NonFiniteLossError``."""
    guard = faults.current()
    timer = StepTimer()
    bar = tqdm(total=last, initial=first - 1, desc=desc, disable=not is_rank0(), dynamic_ncols=True)
    step = first - 1
    try:
        for step in range(first, last + 1):
            if _run_step(step_fn, step, step == last, hooks, guard, timer, bar):
                if is_rank0():
                    bar.write(guard.stopped_message(step, last), file=sys.stderr)
                break
    finally:
        bar.close()  # its line ends before an error's line
        guard.uninstall()
    return step


def _run_step(step_fn, step: int, last: bool, hooks, guard, timer, bar) -> bool:
    """One step and its hooks (none when its loss is not finite); whether a stop signal ends the loop here."""
    timer.start()
    try:
        out = step_fn()
        seconds = timer.stop()
        bar.update(1)
        stop, bad = guard.after_step(step, out)
        if not bad:
            result = StepResult(step, out, seconds, last or stop, bar)
            for hook in hooks:
                hook(result)
    except Exception as e:
        if faults.is_peer_failure(e):
            raise guard.peer_failure(step, e) from e
        raise
    return stop
