"""Qwen2 (``Qwen2ForCausalLM``): Q, K, V biases, full attention in every layer.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds
from pipeline.hf.architectures.decoder import decoder_config_from_hf, decoder_config_to_hf, full_attention_only


def qwen2_config_to_hf(config: GPTConfig) -> dict:
    out = dict(decoder_config_to_hf(config), use_sliding_window=False)
    if config.head_dim == config.hidden_size // config.num_heads:
        del out["head_dim"]  # Qwen2Config has no such field (its attention reads one when it is there)
    return out


def qwen2_config_from_hf(cfg, source: str) -> dict:
    full_attention_only(cfg, source)
    return dict(decoder_config_from_hf(cfg, source), bias=False, qkv_bias=True)


FAMILY = HFFamily(
    model_type="qwen2", variant="llama", config_class="Qwen2Config", architecture="Qwen2ForCausalLM",
    classifier="Qwen2ForSequenceClassification", base="Qwen2Model",
    read=qwen2_config_from_hf, write=qwen2_config_to_hf,
    holds=holds(qkv_bias=True, bias=False))
