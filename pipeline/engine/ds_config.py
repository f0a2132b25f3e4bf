"""DeepSpeed configs checked and resolved before any work: precision, ZeRO stage, batch sizes from the
layout, Hugging Face-style "auto" values (``pipeline.engine.ds_auto``), what the project's engine supports, the
sequence-parallel settings. Errors name the JSON key.
"""
from __future__ import annotations

import copy

from models.config import read_json
from models.parallel import ParallelState

from pipeline.engine.ds_auto import AutoValues, fill_auto, fill_fixed
from pipeline.engine.ds_keys import unknown_key_errors
from pipeline.job.errors import UserError


class EngineConfigError(UserError, ValueError):
    pass


def load_ds_config(path_or_dict) -> dict:
    """The config, the "auto" values that no flag sets filled (``ds_auto.fill_fixed``)."""
    if isinstance(path_or_dict, dict):
        return fill_fixed(path_or_dict)
    return fill_fixed(read_json(path_or_dict, "DeepSpeed config", EngineConfigError))


def enabled(ds: dict, key: str) -> bool:
    return bool(ds.get(key, {}).get("enabled", False))


def precision(ds: dict) -> str:
    return "fp16" if enabled(ds, "fp16") else "bf16" if enabled(ds, "bf16") else "fp32"


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def resolve_ds_config(ds: dict, *, data_parallel: int, pipeline_parallel: int = 1, micro_batch_size: int | None = None,
                      global_batch_size: int | None = None, source: str = "DeepSpeed config",
                      auto: AutoValues | None = None) -> dict:
    """Fill and check the batch sizes and every "auto" (from ``auto``: the flags); refuse what DeepSpeed cannot
    do, before any work starts.

    global batch = micro batch x gradient accumulation steps x data-parallel size.
    """
    unknown = unknown_key_errors(ds, source)
    if unknown:
        raise EngineConfigError(unknown[0] + (f" ({len(unknown) - 1} more unknown key(s) follow it)"
                                              if len(unknown) > 1 else ""))
    ds, _ = fill_auto(ds, auto or AutoValues(), source)
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
                                    f"and/or train_batch_size (or --global-batch-size); an \"auto\" one is "
                                    f"filled from those flags")
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


def context_parallel_ds_config(ds: dict, source: str = "DeepSpeed config", largest_param: int = 0) -> dict:
    """The DeepSpeed config under context parallelism; refuses what would mis-scale ZeRO-3's gradients.

    ZeRO-3 sums the chunks' gradients over data x context (and averages over data) only on its all-reduce path
    (``stage3.__avg_scatter_contiguous_grads`` divides by data x context / C); its reduce-scatter path
    (``__avg_scatter_grads``: ``reduce_scatter_coalesced``) divides by data x context, 1/C of the gradient. The
    all-reduce path is taken for a bucket with ``reduce_scatter`` false, ``contiguous_gradients`` true and no more
    than ``reduce_bucket_size`` elements: the bucket is raised to ``largest_param`` (a parameter alone in its bucket).
    """
    if zero_stage(ds) != 3:
        return ds
    ds = copy.deepcopy(ds)
    zero = ds["zero_optimization"]
    for key, needed in (("reduce_scatter", False), ("contiguous_gradients", True)):  # (others: pipeline.job.layout)
        zero[key] = needed
    zero["reduce_bucket_size"] = max(int(float(zero.get("reduce_bucket_size", 5e8))), largest_param)
    return ds


def whole_stage_activations_ds_config(ds: dict, state: ParallelState) -> dict:
    """The DeepSpeed config of a pipeline whose stages must send their activations whole.

    DeepSpeed's pipeline engine by default splits each activation sent between stages (and its gradient)
    across the TP ranks and joins the pieces on arrival, assuming every TP rank holds the same tensor;
    its activation checkpointing can do the same with ``partition_activations``. Under sequence
    parallelism each rank holds its own chunk (already 1/tp of the tensor); a model whose stages carry several
    tensors (an MoE's auxiliary loss, multi-token prediction's input ids: ``pipe_model.carries_several``) has only
    the first split, and DeepSpeed asserts the others need no gradient, which the auxiliary loss does. Both off
    (a config that sets them is refused by ``pipeline.job.layout``).
    """
    ds = copy.deepcopy(ds)
    if state.pipeline_parallel > 1:
        pipe = ds.setdefault("pipeline", {})
        for key in ("pipe_partitioned", "grad_partitioned"):
            pipe[key] = False
    return ds
