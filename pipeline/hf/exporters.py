"""Each model family's Hugging Face exporter (config + full state dict -> ``HFExport``) and verifier (the project
model's logits), which its spec in ``pipeline.job.families`` holds; ``pipeline.hf.export`` writes and verifies the
directory. transformers is imported only when a model is exported: the family spec imports this module, and most
commands never export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from models import GPT, MLSTM
from models.config import GPTConfig
from models.mlstm import MLSTMConfig
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import to_hf


@dataclass
class HFExport:
    config: Any                        # a transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    generation_config: Any = None      # a transformers GenerationConfig, for generative models


def export_mlstm(config: MLSTMConfig, full_sd: Mapping[str, torch.Tensor], dtype, special_tokens) -> HFExport:
    """-> MLSTMForCausalLM (models/hf_mlstm.py), which ``import models.hf_mlstm`` registers with the Auto classes."""
    from models.hf_mlstm import MLSTMHFConfig  # noqa: PLC0415  transformers (seconds to import) only to export
    cfg = MLSTMHFConfig.from_project(config, **{k: v for k, v in special_tokens.items() if v is not None})
    cfg.architectures = ["MLSTMForCausalLM"]
    cfg.dtype = dtype or torch.float32
    sd = {f"mlstm.{k}": (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in full_sd.items()}
    return HFExport(cfg, sd)


def export_gpt(config: GPTConfig, full_sd: Mapping[str, torch.Tensor], dtype, special_tokens) -> HFExport:
    from transformers import GenerationConfig  # noqa: PLC0415  only to export: the family spec imports this module
    cfg, sd = to_hf(full_sd, config, dtype, special_tokens, lazy=True)  # made one at a time as it is written
    gen = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                           pad_token_id=cfg.pad_token_id)
    return HFExport(cfg, sd, gen)


def gpt_logits(config: GPTConfig, full_sd: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    model = GPT(config).eval()
    load_full_state_dict(model, full_sd)
    return model(tokens)


def mlstm_logits(config: MLSTMConfig, full_sd: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    model = MLSTM(config).eval()
    load_full_state_dict(model, full_sd)
    return model(tokens)[0]
