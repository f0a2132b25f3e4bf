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
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from deepspeed.utils import logger as ds_logger
from tqdm import tqdm

from models.parallel import Layout, ParallelState, initialize_model_parallel, model_parallel_seed
from pipeline.engine.cpu_features import warn_if_bf16_is_emulated
from pipeline.engine.distributed import init_distributed, launched_world_size
from pipeline.engine.ds_config import load_ds_config, precision, resolve_ds_config
from pipeline.job.errors import is_rank0
from pipeline.job.layout import LayoutCheck, layout_from_options, validate
from pipeline.tracking.metrics import StepTimer, place_monitor_outputs
from pipeline.job import faults
from pipeline.job.options import EngineOptions, default_ds_config


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclass
class Job:
    """What ``setup`` made: the run's layout (validated), its process groups and the resolved DeepSpeed config."""
    options: EngineOptions
    state: ParallelState
    ds: dict
    ds_source: str

    @property
    def layout(self) -> Layout:
        return self.state.layout

    @property
    def micro_batch(self) -> int:
        return self.ds["train_micro_batch_size_per_gpu"]

    @property
    def global_batch(self) -> int:
        return self.ds["train_batch_size"]

    def record(self, model_type: str) -> dict:
        """What a checkpoint records of the run (``checkpoint.same_layout`` compares it on resume): the layout."""
        return {**self.layout.record(), "model_type": model_type, "universal_info": True}


def quiet_deepspeed(verbose: bool) -> None:
    ds_logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:  # ZeRO's gathers call a collective torch deprecates: a FutureWarning per rank, nothing to act on
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                                category=FutureWarning)


def setup(options: EngineOptions, *, config=None, family=None, extras: dict | None = None) -> Job:
    """Build the run's ``Layout`` from ``options`` and the DeepSpeed config and validate it with the model
    ``config`` (``pipeline.job.layout``: every combination rule, before any work), then join the process group,
    build the layout's process groups, seed every rank and resolve the DeepSpeed config's batch sizes (DeepSpeed's
    keys only: ``resolve_ds_config`` refuses others, e.g. ``peak_tflops``, now ``--peak-tflops``)."""
    source = options.deepspeed_config or default_ds_config()
    ds = load_ds_config(source)
    world = launched_world_size()
    layout = layout_from_options(options, ds, world)
    validate(LayoutCheck(layout, config, family, ds, source, {"world": world, **(extras or {})}))
    if not options.verbose:
        quiet_deepspeed(False)
    init_distributed(timeout_minutes=options.distributed_timeout_minutes)
    state = initialize_model_parallel(layout=layout)
    model_parallel_seed(options.seed)
    ds = resolve_ds_config(ds, data_parallel=state.data_parallel, pipeline_parallel=state.pipeline_parallel,
                           micro_batch_size=options.micro_batch_size, global_batch_size=options.global_batch_size,
                           source=source, auto=options.auto_values(config))
    faults.configure(options.save, exit_signal_handler=options.exit_signal_handler,
                     max_bad_steps=options.max_bad_steps, fp16=precision(ds) == "fp16")
    ds = place_monitor_outputs(ds, Path(options.save) if options.save else None)
    warn_if_bf16_is_emulated(precision(ds))
    return Job(options, state, ds, source)


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
