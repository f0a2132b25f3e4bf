"""Hugging Face-style DeepSpeed configs: each ``"auto"`` filled from the flags and the layout, as transformers'
integration fills it (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``), and any
``"auto"`` that nothing here can fill refused in one line.

    batch sizes           train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size: from
                          --micro-batch-size / --global-batch-size and the data-parallel size (resolve_ds_config)
    optimizer.params      lr: --lr (refused without it); weight_decay 0.0, betas [0.9, 0.999], eps 1e-8
                          (transformers' TrainingArguments defaults: these commands have no flag for them)
    scheduler.params      warmup_min_lr 0, warmup_max_lr --lr, warmup_num_steps --lr-warmup-steps (default 1% of
                          --train-steps, at least 1), total_num_steps --train-steps
    gradient_clipping     1.0 (TrainingArguments' max_grad_norm)
    fp16/bf16 enabled     fp16 off; bf16 on where the GPU computes in bf16, else off (fp32)
    zero_optimization     reduce_bucket_size hidden^2; ZeRO-3 stage3_prefetch_bucket_size 0.9 hidden^2,
                          stage3_param_persistence_threshold 10 hidden
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from pipeline.job.errors import UserError

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
DEEPSPEED_OWN_AUTO = {"pipeline.stages"}  # DeepSpeed's own "auto" values, not Hugging Face's
HF_DEFAULTS = {"optimizer.params.weight_decay": 0.0, "optimizer.params.betas": [0.9, 0.999],
               "optimizer.params.eps": 1e-8, "scheduler.params.warmup_min_lr": 0, "gradient_clipping": 1.0}


@dataclass
class AutoValues:
    """What a command's flags say about the "auto" keys (None: the flag was not given)."""
    lr: float | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    hidden_size: int | None = None


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def fill_fixed(ds: dict) -> dict:
    """The "auto" values no flag sets: precision (fp16 off, bf16 where the GPU has it) and transformers'
    defaults. Filled as soon as the config is read: the layout's rules read the precision and the clipping."""
    ds = copy.deepcopy(ds)
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    for key, value in (("fp16", False), ("bf16", bf16)):
        if isinstance(ds.get(key), dict) and is_auto(ds[key].get("enabled")):
            ds[key]["enabled"] = value
    for dotted, value in HF_DEFAULTS.items():
        parent, key = _parent(ds, dotted)
        if parent is not None and is_auto(parent.get(key)):
            parent[key] = copy.copy(value)
    return ds


def fill_auto(ds: dict, values: AutoValues, source: str) -> tuple[dict, list[str]]:
    """(the config with every "auto" outside the batch sizes filled, the dotted keys filled); refuses what cannot
    be filled. The batch sizes' "auto" are dropped: ``resolve_ds_config`` derives them from the flags and the
    layout. A given --lr also replaces a number in ``optimizer.params.lr``: the flag sets the optimizer's lr."""
    ds = fill_fixed(ds)
    filled = []
    for key in BATCH_KEYS:
        if is_auto(ds.get(key)):
            del ds[key]
            filled.append(key)
    warmup = values.warmup_steps
    if warmup is None and values.total_steps is not None:
        warmup = max(1, values.total_steps // 100)
    hidden = values.hidden_size
    fills = {"optimizer.params.lr": values.lr, "scheduler.params.warmup_max_lr": values.lr,
             "scheduler.params.warmup_num_steps": warmup, "scheduler.params.total_num_steps": values.total_steps,
             "zero_optimization.reduce_bucket_size": hidden and hidden * hidden,
             "zero_optimization.stage3_prefetch_bucket_size": hidden and int(0.9 * hidden * hidden),
             "zero_optimization.stage3_param_persistence_threshold": hidden and 10 * hidden}
    for dotted, value in fills.items():
        parent, key = _parent(ds, dotted)
        if parent is not None and is_auto(parent.get(key)) and value is not None:
            parent[key] = value
            filled.append(dotted)
    params = ds.get("optimizer", {}).get("params") if isinstance(ds.get("optimizer"), dict) else None
    if values.lr is not None and isinstance(params, dict) and "lr" in params:
        params["lr"] = values.lr
    left = [k for k in auto_keys(ds) if k not in DEEPSPEED_OWN_AUTO]
    if left:
        raise _unfillable(source, left[0])
    return ds, filled


def _parent(ds: dict, dotted: str) -> tuple[dict | None, str]:
    *path, key = dotted.split(".")
    node = ds
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), key


def auto_keys(node, prefix: str = "") -> list[str]:
    """The dotted keys whose value is "auto"."""
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        found += [dotted] if is_auto(value) else auto_keys(value, dotted + ".")
    return found


class AutoConfigError(UserError, ValueError):
    pass


def _unfillable(source: str, key: str) -> AutoConfigError:
    flag = {"optimizer.params.lr": "--lr", "scheduler.params.warmup_max_lr": "--lr",
            "scheduler.params.total_num_steps": "--train-steps"}.get(key)
    remedy = f"pass {flag} or give a number" if flag else "give it a value (nothing in this command fills it)"
    return AutoConfigError(f"{source}: {key} is \"auto\" and cannot be filled here; {remedy}")
