"""The GPT family's Hugging Face exporter (config + full state dict -> ``HFExport``: a transformers GPT2, Llama,
Mistral, Qwen or MoE model, ``pipeline.hf.convert``) and verifier (the project model's logits);
``pipeline.hf.export`` writes and verifies the directory. transformers is imported only when a model is exported.
"""
from __future__ import annotations

from typing import Mapping

import torch

from models import GPT
from models.config import GPTConfig
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import to_hf
from pipeline.hf.exporters import HFExport


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
