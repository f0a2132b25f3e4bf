"""Misspelled DeepSpeed config keys are refused, with a "did you mean".

DeepSpeed reads the keys it knows and ignores the others, so ``"train_batch_sise"`` or
``"zero_optimisation"`` would train with defaults and no word. The keys it knows are its own
constants (``deepspeed.runtime.config``'s namespace), the sections its sub-configs read, and, for
the pydantic sections, the fields (and aliases) of their models.
"""
from __future__ import annotations

import difflib

import deepspeed.runtime.config as ds_config
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

# Sections DeepSpeed 0.19.8 reads through sub-config classes whose key constants live elsewhere.
_SECTIONS = ("zero_optimization", "activation_checkpointing", "comms_logger", "tensorboard", "wandb", "csv_monitor",
             "comet", "flops_profiler", "autotuning", "hybrid_engine", "pipeline", "aio", "datastates_ckpt",
             "weight_quantization", "compile", "timers", "tensor_parallel", "expert_parallel", "amp", "elasticity",
             "compression_training", "sparse_attention", "sparse_gradients", "eigenvalue", "progressive_layer_drop",
             "quantize_training", "nebula", "sequence_parallel_size", "data_efficiency", "curriculum_learning")
# Keys of this project that used to sit in the DeepSpeed JSON, and where they go now.
_PROJECT_KEYS = {"peak_tflops": "peak_tflops is not a DeepSpeed key; pass --peak-tflops (per-device peak TFLOP/s "
                                "for the MFU in metrics.jsonl) instead and remove it from the config"}


def top_level_keys() -> set[str]:
    constants = {v for k, v in vars(ds_config).items()
                 if k.isupper() and not k.endswith("DEFAULT") and isinstance(v, str) and v.isidentifier()}
    return constants | set(_SECTIONS)


def section_keys() -> dict[str, set[str]]:
    """The keys of the sections this project reads (a pydantic model's fields and their aliases)."""

    def fields(model) -> set[str]:
        return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}
    return {"zero_optimization": fields(DeepSpeedZeroConfig), "fp16": fields(DeepSpeedFP16Config),
            "bf16": fields(DeepSpeedBF16Config), "optimizer": {"type", "params", "legacy_fusion"},
            "scheduler": {"type", "params"}}


def _refusal(source: str, where: str, key: str, known) -> str:
    if key in _PROJECT_KEYS:
        return f"{source}: {where}{key}: {_PROJECT_KEYS[key]}"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "check the spelling against DeepSpeed's config documentation"
    return f"{source}: unknown DeepSpeed config key '{where}{key}'; {hint}"


def unknown_key_errors(ds: dict, source: str = "DeepSpeed config") -> list[str]:
    """One message per unknown key: top level, and inside the sections this project reads."""
    errors = []
    known = top_level_keys()
    errors += [_refusal(source, "", k, known) for k in ds if k not in known]
    for section, keys in section_keys().items():
        value = ds.get(section)
        if isinstance(value, dict):
            errors += [_refusal(source, f"{section}.", k, keys) for k in value if k not in keys]
    return errors
