"""Qwen3 (``Qwen3ForCausalLM``): RMS norms of the queries and keys, no biases, full attention in every layer.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds, refuse
from pipeline.hf.architectures.decoder import decoder_config_from_hf, decoder_config_to_hf, full_attention_only


def qwen3_config_to_hf(config: GPTConfig) -> dict:
    return dict(decoder_config_to_hf(config), use_sliding_window=False, attention_bias=False)


def qwen3_config_from_hf(cfg, source: str) -> dict:
    full_attention_only(cfg, source)
    if getattr(cfg, "attention_bias", False):
        refuse(source, "attention_bias", True, "a Qwen3 model without attention biases")
    return dict(decoder_config_from_hf(cfg, source), bias=False, qk_norm=True)


FAMILY = HFFamily(
    model_type="qwen3", variant="llama", config_class="Qwen3Config", architecture="Qwen3ForCausalLM",
    classifier="Qwen3ForSequenceClassification", base="Qwen3Model",
    read=qwen3_config_from_hf, write=qwen3_config_to_hf,
    holds=holds(qk_norm=True, bias=False))
