"""LoRA adapters named as PEFT names them, and written as PEFT writes them.

``lora_targets`` reads PEFT's ``LoraConfig.target_modules`` (matched by PEFT's own rule,
``check_target_module_exists``) against the Hugging Face module names of the project's linears, from the same
weight table the export uses (``pipeline.hf.convert.weight_map``): Llama-family ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; gpt2's ``c_attn``, ``c_proj``, ``c_fc``. Each
Hugging Face module is one adapter group of the project's fused linear (``models.lora``).

``export_peft_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` that
``PeftModel.from_pretrained(<the HF export of the base>, <dir>)`` loads; ``merged_state_dict`` folds the adapters
into the base weights (``W + alpha / r * B A``) for a plain Hugging Face export.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from models.config import GPTConfig
from models.lora import LORA_MODULE, LoRAConfig, add_lora
from pipeline.hf.convert import weight_map
from pipeline.hf.safetensors_io import SafetensorsFiles, write_safetensors
from pipeline.job.errors import UserError
from pipeline.job.files import atomic_dir

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's module names, as PEFT saves them
_COLUMN = ("attention.qkv", "mlp.fc_in")   # the dense layers' column-parallel linears
_ROW = ("attention.dense", "mlp.fc_out")   # and row-parallel ones
# PEFT options that change what the adapter computes and that models.lora does not implement
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
                "target_parameters": None, "layer_replication": None, "modules_to_save": None}


class AdapterError(UserError, ValueError):
    """A LoRA configuration or adapter that does not fit the model."""


@dataclass(frozen=True)
class LoRATarget:
    module: str                   # the project's linear: "layers.0.attention.qkv"
    group: int                    # index of this adapter among the linear's groups ("<module>.lora.A.<group>")
    parts: tuple[int, ...]        # the output parts it updates (a column-parallel linear; () a row-parallel one)
    rows: tuple[int, int]         # (first, count) rows of the full base weight it updates
    hf_module: str                # Hugging Face's: "model.layers.0.self_attn.q_proj"

    def project_name(self, matrix: str) -> str:
        return f"{self.module}.{LORA_MODULE}.{matrix}.{self.group}"

    def peft_name(self, matrix: str) -> str:
        return f"{PEFT_PREFIX}{self.hf_module}.lora_{matrix}.weight"


def _linears(config: GPTConfig) -> list[LoRATarget]:
    """Every adaptable Hugging Face module of ``config``'s dense layers as a (module, parts) of the project's."""
    out = []
    for rule in weight_map(config):
        module = rule.ours.removesuffix(".weight")
        if not (rule.ours.endswith(".weight") and module.startswith("layers.")
                and module.split(".", 2)[2] in _COLUMN + _ROW):
            continue
        row = module.split(".", 2)[2] in _ROW
        hf = [name.removesuffix(".weight") for name in rule.theirs]
        sizes = list(rule.split) if rule.split else [rule.shape[0]]
        if len(hf) == 1:  # one Hugging Face module for the whole linear (gpt2's c_attn, a row-parallel one)
            parts = () if row else tuple(range(_parts_of(module, config)))
            out.append(LoRATarget(module, 0, parts, (0, rule.shape[0]), hf[0]))
            continue
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out += [LoRATarget(module, i, (i,), (starts[i], sizes[i]), name) for i, name in enumerate(hf)]
    return out


def _parts_of(module: str, config: GPTConfig) -> int:
    if module.endswith("attention.qkv"):
        return 3
    return config.fc_in_parts  # a gated MLP's fc_in is [gate; up]


def check_lora_config(lora: LoraConfig, where: str = "LoRA config") -> None:
    for field, default in _UNSUPPORTED.items():
        value = getattr(lora, field, default)
        if value not in (default, None) and not (isinstance(value, (dict, list)) and not value):
            raise AdapterError(f"{where}: {field}={value!r} is not supported by the project's LoRA; leave it at "
                               f"{default!r}")


def lora_targets(config: GPTConfig, lora: LoraConfig, where: str = "target_modules") -> list[LoRATarget]:
    """The adapters PEFT would put on the Hugging Face export of ``config`` for ``lora.target_modules``; a name
    that matches none of the model's linears is refused."""
    check_lora_config(lora)
    linears = _linears(config)
    if lora.target_modules == "all-linear":
        return _numbered(linears)
    names = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules or [])
    short = sorted({t.hf_module.rsplit(".", 1)[-1] for t in linears})
    for name in names:
        single = LoraConfig(target_modules=[name]) if not isinstance(lora.target_modules, str) else lora
        if not any(check_target_module_exists(single, t.hf_module) for t in linears):
            raise AdapterError(f"{where}: {name!r} names no linear of this {config.variant} model that LoRA can "
                               f"adapt; choose from {', '.join(short)}")
    chosen = [t for t in linears if check_target_module_exists(lora, t.hf_module)]
    if not chosen:
        raise AdapterError(f"{where}: no module matched; choose from {', '.join(short)}")
    return _numbered(chosen)


def project_targets(targets: list[LoRATarget]) -> dict[str, list[tuple[int, ...]] | None]:
    """``models.lora.add_lora``'s targets: module -> its groups of output parts, in group order."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for t in targets:
        out.setdefault(t.module, []).append(t.parts)
    return {m: (None if groups == [()] else groups) for m, groups in out.items()}


def _numbered(targets: list[LoRATarget]) -> list[LoRATarget]:
    """``targets`` with ``group`` numbered as ``add_lora`` numbers a linear's groups (0, 1, ... in order)."""
    seen: dict[str, int] = {}
    out = []
    for t in targets:
        out.append(LoRATarget(t.module, seen.get(t.module, 0), t.parts, t.rows, t.hf_module))
        seen[t.module] = seen.get(t.module, 0) + 1
    return out


def adapter_to_peft(adapter_sd: Mapping[str, torch.Tensor], targets: list[LoRATarget]) -> dict[str, torch.Tensor]:
    """PEFT's saved names (``base_model.model.<module>.lora_A.weight``) of a full adapter state dict."""
    return {t.peft_name(m): adapter_sd[t.project_name(m)].contiguous() for t in targets for m in "AB"}


def adapter_from_peft(peft_sd: Mapping[str, torch.Tensor], targets: list[LoRATarget],
                      where: str = "adapter") -> dict[str, torch.Tensor]:
    """The project's full adapter state dict from PEFT's saved (or ``get_peft_model_state_dict``) tensors."""
    sd = {k.replace(".default.weight", ".weight"): v for k, v in peft_sd.items()}
    missing = [t.peft_name(m) for t in targets for m in "AB" if t.peft_name(m) not in sd]
    if missing:
        raise AdapterError(f"{where}: missing {', '.join(missing[:4])}; the adapter was not trained for these "
                           f"target modules")
    return {t.project_name(m): sd[t.peft_name(m)] for t in targets for m in "AB"}


def peft_lora_config(lora: LoRAConfig, target_modules, base: str | None = None) -> LoraConfig:
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules,
                      task_type="CAUSAL_LM", base_model_name_or_path=base)


def export_peft_adapter(out: str | Path, lora: LoraConfig, adapter_sd: Mapping[str, torch.Tensor],
                        targets: list[LoRATarget], *, force: bool = False) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a full adapter state dict, atomically."""
    config = lora.to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # as PeftConfig.save_pretrained
    with atomic_dir(out, force=force) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
        write_safetensors(tmp / SAFETENSORS_WEIGHTS_NAME, adapter_to_peft(adapter_sd, targets),
                          metadata={"format": "pt"})
    return Path(out)


def read_peft_adapter(directory: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory's config and tensors (safetensors only: nothing is unpickled)."""
    directory = Path(directory)
    weights = directory / SAFETENSORS_WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError(f"{directory}: no {SAFETENSORS_WEIGHTS_NAME}; save the adapter with safetensors")
    lora = LoraConfig.from_pretrained(str(directory))
    check_lora_config(lora, str(directory / CONFIG_NAME))
    files = SafetensorsFiles([weights])
    return lora, {name: files[name] for name in files}


def merged_state_dict(full_sd: Mapping[str, torch.Tensor], adapter_sd: Mapping[str, torch.Tensor],
                      targets: list[LoRATarget], scaling: float) -> dict[str, torch.Tensor]:
    """The base's full state dict with every adapter folded in: ``W[rows] += scaling * B @ A``."""
    merged = {k: v for k, v in full_sd.items() if f".{LORA_MODULE}." not in k}
    for t in targets:
        name = f"{t.module}.weight"
        delta = scaling * (adapter_sd[t.project_name("B")].double() @ adapter_sd[t.project_name("A")].double())
        weight = merged[name].clone()
        first, count = t.rows
        weight[first:first + count] += delta.to(weight.dtype)
        merged[name] = weight
    return merged


def add_peft_lora(model: torch.nn.Module, config: GPTConfig, lora: LoraConfig, seed: int | None = None
                  ) -> list[LoRATarget]:
    """Freeze the project's GPT ``model`` and put PEFT's adapters ``lora`` on its linears; the targets. ``seed``:
    each linear's adapters drawn from it and the linear's name, as the commands draw them (``add_lora``)."""
    targets = lora_targets(config, lora)
    add_lora(model, project_targets(targets), LoRAConfig(lora.r, lora.lora_alpha, lora.lora_dropout), seed=seed)
    return targets
