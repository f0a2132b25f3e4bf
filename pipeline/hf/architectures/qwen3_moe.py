"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, Qwen's MoE layers without a shared expert.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds
from pipeline.hf.architectures.decoder import qwen_moe_fields_from_hf, qwen_moe_fields_to_hf
from pipeline.hf.architectures.qwen3 import qwen3_config_from_hf, qwen3_config_to_hf
from pipeline.hf.experts import QWEN3_MOE_EXPERTS


def _qwen3_moe_config_to_hf(config: GPTConfig) -> dict:
    return dict(qwen3_config_to_hf(config), **qwen_moe_fields_to_hf(config))


def _qwen3_moe_config_from_hf(cfg, source: str) -> dict:
    """Qwen3-MoE: Qwen3's attention, Qwen's MoE layers without a shared expert."""
    return dict(qwen3_config_from_hf(cfg, source), **qwen_moe_fields_from_hf(cfg, source, "Qwen3"))


FAMILY = HFFamily(
    model_type="qwen3_moe", variant="llama", config_class="Qwen3MoeConfig", architecture="Qwen3MoeForCausalLM",
    classifier="Qwen3MoeForSequenceClassification", base="Qwen3MoeModel",
    read=_qwen3_moe_config_from_hf, write=_qwen3_moe_config_to_hf,
    holds=holds(qk_norm=True, bias=False, moe=True, sparse_layers=True),
    experts=QWEN3_MOE_EXPERTS)
