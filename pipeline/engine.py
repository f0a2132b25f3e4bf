"""DeepSpeed engine wiring: config checks, the model at any (TP, PP, DP) layout, one training step.

PP = 1: the GPT goes to ``deepspeed.initialize(mpu=...)``, so gradients are
reduced over the data-parallel group only and the global gradient norm counts
each tensor-parallel shard once. PP > 1: the GPT becomes a ``PipelineModule``
on the same 3-D topology and trains with ``train_batch``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import deepspeed
import torch
import torch.distributed as dist

from models import GPT
from models.config import read_json
from models.parallel import ParallelState

from . import safe_load
from .ds_keys import unknown_key_errors
from .errors import UserError
from .pipe_model import gpt_pipeline, pipe_to_gpt_name
from .schedules import LRSchedule, Scheduler
from .state_dicts import load_full_state_dict
from .universal import attach_info


class EngineConfigError(UserError, ValueError):
    pass


def load_ds_config(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    return read_json(path_or_dict, "DeepSpeed config", EngineConfigError)


def _enabled(ds: dict, key: str) -> bool:
    return bool(ds.get(key, {}).get("enabled", False))


def precision(ds: dict) -> str:
    return "fp16" if _enabled(ds, "fp16") else "bf16" if _enabled(ds, "bf16") else "fp32"


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def resolve_ds_config(ds: dict, *, data_parallel: int, pipeline_parallel: int = 1, micro_batch_size: int | None = None,
                      global_batch_size: int | None = None, source: str = "DeepSpeed config") -> dict:
    """Fill and check the batch sizes; refuse what DeepSpeed cannot do, before any work starts.

    global batch = micro batch x gradient accumulation steps x data-parallel size.
    """
    ds = copy.deepcopy(ds)
    unknown = unknown_key_errors(ds, source)
    if unknown:
        raise EngineConfigError(unknown[0] + (f" ({len(unknown) - 1} more unknown key(s) follow it)"
                                              if len(unknown) > 1 else ""))
    if micro_batch_size is not None:
        ds["train_micro_batch_size_per_gpu"] = micro_batch_size
    if global_batch_size is not None:
        ds["train_batch_size"] = global_batch_size
        if micro_batch_size is not None or "train_micro_batch_size_per_gpu" in ds:
            ds.pop("gradient_accumulation_steps", None)
    micro = ds.get("train_micro_batch_size_per_gpu")
    glob = ds.get("train_batch_size")
    gas = ds.get("gradient_accumulation_steps")
    if micro is None:
        if glob is None:
            raise EngineConfigError(f"{source}: set train_micro_batch_size_per_gpu (or --micro-batch-size) "
                                    f"and/or train_batch_size (or --global-batch-size)")
        micro = glob // (data_parallel * (gas or 1))
    if glob is None:
        glob = micro * (gas or 1) * data_parallel
    if micro < 1 or glob % (micro * data_parallel):
        raise EngineConfigError(
            f"{source}: the global batch {glob} is not a multiple of micro batch {micro} x data-parallel size "
            f"{data_parallel} = {micro * data_parallel}; choose a global batch that is a multiple of "
            f"{micro * data_parallel} or another micro batch")
    if gas is not None and gas != glob // (micro * data_parallel):
        raise EngineConfigError(
            f"{source}: train_batch_size {glob} != micro batch {micro} x gradient_accumulation_steps {gas} x "
            f"data-parallel size {data_parallel}; drop one of the three so the others determine it")
    ds.update(train_batch_size=glob, train_micro_batch_size_per_gpu=micro,
              gradient_accumulation_steps=glob // (micro * data_parallel))
    check_supported(ds, pipeline_parallel, source)
    _prefer_fused_torch_adam(ds)
    return ds


def _prefer_fused_torch_adam(ds: dict) -> None:
    """``torch_adam`` makes DeepSpeed build ``torch.optim.AdamW`` with torch's default implementation, which
    for CPU tensors is a Python loop of one kernel per operation; unless the config chooses ``foreach`` or
    ``fused`` itself, take torch's fused kernel (CPU and CUDA alike: one pass over each tensor)."""
    params = ds.get("optimizer", {}).get("params", {})
    if (ds.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw") and params.get("torch_adam")
            and "fused" not in params and "foreach" not in params):
        params["fused"] = True


def check_supported(ds: dict, pipeline_parallel: int, source: str = "DeepSpeed config") -> None:
    if _enabled(ds, "fp16") and _enabled(ds, "bf16"):
        raise EngineConfigError(f"{source}: fp16 and bf16 are both enabled; enable one of them (set the other's "
                                f"\"enabled\" to false)")
    if _enabled(ds, "fp16") and zero_stage(ds) == 0 and pipeline_parallel == 1:
        # Measured with DeepSpeed 0.19.8: engine.backward scales the loss only for ZeRO optimizers,
        # so its ZeRO-0 fp16 optimizer unscales gradients that were never scaled (updates / 2^16).
        raise EngineConfigError(f"{source}: fp16 needs ZeRO stage 1 or 2 here (DeepSpeed's ZeRO-0 fp16 optimizer "
                                f"does not apply the loss scale in engine.backward); set zero_optimization.stage "
                                f"to 1, or use bf16")
    if pipeline_parallel > 1 and zero_stage(ds) > 1:
        raise EngineConfigError(
            f"{source}: ZeRO stage {zero_stage(ds)} cannot be combined with pipeline parallelism "
            f"(pipeline_parallel={pipeline_parallel}); use ZeRO stage 0 or 1 with pipelines, or --pipeline-parallel 1")
    if (pipeline_parallel > 1 and zero_stage(ds) == 0 and precision(ds) == "fp32"
            and float(ds.get("gradient_clipping", 0.0)) > 0):
        # DeepSpeed's plain fp32 pipeline path clips with a norm that counts tied weights on every
        # stage that holds them; its ZeRO-1 and mixed-precision optimizers count them once.
        raise EngineConfigError(f"{source}: gradient clipping with pipeline parallelism in fp32 needs ZeRO stage 1 "
                                f"(set zero_optimization.stage to 1), bf16/fp16, or gradient_clipping 0")
    if pipeline_parallel > 1 and ds.get("zero_optimization", {}).get("offload_optimizer"):
        raise EngineConfigError(f"{source}: optimizer offload is not supported with pipeline parallelism")


def sequence_parallel_ds_config(ds: dict, state: ParallelState, source: str = "DeepSpeed config") -> dict:
    """The DeepSpeed config for a sequence-parallel model; refuses what would mix up the ranks' chunks.

    DeepSpeed's pipeline engine by default splits each activation sent between stages (and its gradient)
    across the TP ranks and joins the pieces on arrival, assuming every TP rank holds the same tensor;
    its activation checkpointing can do the same with ``partition_activations``. Under sequence
    parallelism each rank holds its own chunk (already 1/tp of the tensor), so both must be off.
    """
    ds = copy.deepcopy(ds)
    if ds.get("activation_checkpointing", {}).get("partition_activations"):
        raise EngineConfigError(f"{source}: activation_checkpointing.partition_activations splits activations "
                                f"that sequence parallelism has already split across the TP ranks; set it to false")
    if state.pipeline_parallel > 1:
        pipe = ds.setdefault("pipeline", {})
        for key in ("pipe_partitioned", "grad_partitioned"):
            if pipe.get(key):
                raise EngineConfigError(f"{source}: pipeline.{key} is true, but under sequence parallelism each TP "
                                        f"rank sends its own sequence chunk between stages; set it to false "
                                        f"(or leave it out)")
            pipe[key] = False
    return ds


def param_groups(model: torch.nn.Module, weight_decay: float | None = None) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), as Megatron and GPT-2 train."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    return [g for g in groups if g["params"]]


def build_engine(model_config, ds_config: dict, state: ParallelState, *, init_seed: int,
                 schedule: LRSchedule | None = None, activation_checkpointing: bool = False, model_builder=None,
                 full_state_dict: dict | None = None, param_groups_fn=None):
    """A DeepSpeed engine for the GPT (or any model ``model_builder(config, init_seed=...)`` returns, PP=1 only).

    ``ds_config`` must have been through ``resolve_ds_config``. ``full_state_dict`` (full TP=1 weights,
    e.g. of a checkpoint saved at another layout) is loaded into this rank's shards before DeepSpeed
    takes the model, so its fp32 master weights start from it. ``param_groups_fn(model)`` gives the
    optimizer's parameter groups (default ``param_groups``); a group's ``lr_mult`` scales the scheduled
    learning rate (e.g. layer-wise decay when finetuning). Returns the engine; ``engine.is_pipe``
    tells which training step to use.
    """

    check_supported(ds_config, state.pipeline_parallel)
    if getattr(model_config, "sequence_parallel", False):
        ds_config = sequence_parallel_ds_config(ds_config, state)
    checkpoint_fn = None
    if activation_checkpointing:
        deepspeed.checkpointing.configure(state, deepspeed_config=ds_config)
        checkpoint_fn = deepspeed.checkpointing.checkpoint

    if state.pipeline_parallel > 1:
        if model_builder is not None:
            raise EngineConfigError("pipeline parallelism is only available for the GPT models")
        model = gpt_pipeline(model_config, state, init_seed, activation_checkpointing=activation_checkpointing,
                             checkpoint_fn=checkpoint_fn)
        mpu = None  # the PipelineEngine builds its grid from the module's topology
        if full_state_dict is not None:
            load_full_state_dict(model, full_state_dict, partial=True, source="checkpoint weights",
                                 name_map=lambda n: pipe_to_gpt_name(n, model_config))
    else:
        if model_builder is None:
            model_builder = GPT
        model = model_builder(model_config, init_seed=init_seed)
        if full_state_dict is not None:
            load_full_state_dict(model, full_state_dict, source="checkpoint weights")
        if checkpoint_fn is not None:
            model.checkpoint_fn = checkpoint_fn
        mpu = state
        if zero_stage(ds_config) == 3 and getattr(model, "lm_head", 1) is None:
            # the tied output layer reads the embedding weight outside the embedding's forward
            deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)

    attach_info(model, model_config, pipeline=state.pipeline_parallel > 1)  # saved with every checkpoint

    if schedule is not None and "scheduler" in ds_config:
        raise EngineConfigError("the DeepSpeed config has a \"scheduler\" section and a learning-rate schedule was "
                                "given too; remove one of them")
    lr_scheduler = (lambda opt: Scheduler(opt, schedule)) if schedule is not None else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=(param_groups_fn or param_groups)(model),
                                           config=ds_config,
                                           mpu=mpu, lr_scheduler=lr_scheduler)
    safe_load.install(engine)  # loads weights only, hashes what it saves
    engine.is_pipe = state.pipeline_parallel > 1
    if not engine.is_pipe and zero_stage(ds_config) == 0 and state.data_parallel == 1:
        # Without ZeRO, DeepSpeed flattens every gradient into buckets, all-reduces them over the
        # data-parallel group and copies them back, even when that group is this one process.
        engine.enable_backward_allreduce = False
    return engine


def lm_batches(loader):
    """(inputs, labels) pairs from batches of packed token sequences [b, s + 1]; (inputs, labels,
    {"reset": ...}) for the streams of truncated BPTT."""
    for batch in loader:
        tokens = batch["tokens"]
        pair = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        yield (*pair, {"reset": batch["reset"]}) if "reset" in batch else pair


def lm_forward(engine, batch) -> torch.Tensor:
    """The loss of one (inputs, labels[, extra kwargs]) micro-batch of ``lm_batches``."""
    inputs, labels, *extra = batch
    kwargs = {k: v.to(engine.device) for k, v in (extra[0] if extra else {}).items()}
    return engine(inputs.to(engine.device), labels.to(engine.device), **kwargs)


def data_parallel_mean(engine, values: torch.Tensor, *, summed: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` averaged over the data-parallel group (in place; one all-reduce). Where the boolean mask
    ``summed`` is true the entry is summed instead (counts such as tokens)."""
    mpu = engine.mpu
    if mpu is not None and mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(values, group=mpu.get_data_parallel_group())
        scale = torch.full_like(values, 1.0 / mpu.get_data_parallel_world_size())
        if summed is not None:
            scale[summed] = 1.0
        values *= scale
    return values


def optimizer_step(engine, batches, forward: Callable = lm_forward, *, counts: Sequence[str] = ()) -> dict:
    """One optimizer step over all micro-batches of the global batch (non-pipeline engines).

    ``forward(engine, batch)`` returns the loss, or a dict with the loss under "loss" and other scalars to
    log. Each is averaged over the micro-batches and the data-parallel ranks, except the ``counts``
    (summed). Returns floats, after one device sync.
    """
    gas = engine.gradient_accumulation_steps()
    totals, keys = None, None
    for _ in range(gas):
        out = forward(engine, next(batches))
        parts = out if isinstance(out, dict) else {"loss": out}
        engine.backward(parts["loss"])
        engine.step()
        keys = keys or list(parts)
        values = torch.stack([torch.as_tensor(parts[k], device=engine.device).detach().double().reshape(())
                              for k in keys])
        totals = values if totals is None else totals + values
    summed = torch.tensor([k in counts for k in keys], device=engine.device)
    totals = torch.where(summed, totals, totals / gas)
    totals = data_parallel_mean(engine, totals, summed=summed).cpu()
    return {k: float(v) for k, v in zip(keys, totals)}


def train_step(engine, batches) -> float:
    """One optimizer step (all micro-batches of the global batch); the mean loss over them and over DP."""
    if engine.is_pipe:
        return float(engine.train_batch(data_iter=batches))
    return optimizer_step(engine, batches)["loss"]


def eval_loss(engine, batches, num_batches: int) -> float:
    """Mean loss over ``num_batches`` global batches, without gradients."""
    total = 0.0
    if engine.is_pipe:
        for _ in range(num_batches):
            total += float(engine.eval_batch(data_iter=batches))
        return total / num_batches
    engine.eval()
    with torch.no_grad():
        for _ in range(num_batches * engine.gradient_accumulation_steps()):
            total += float(lm_forward(engine, next(batches)))
    engine.train()
    total = torch.tensor(total / (num_batches * engine.gradient_accumulation_steps()), device=engine.device)
    return float(data_parallel_mean(engine, total.reshape(1)))


def loss_scale(engine) -> float:
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if value is not None and not callable(value):
            return float(value)
    return 1.0
