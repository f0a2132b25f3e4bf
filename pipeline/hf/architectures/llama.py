"""Llama (``LlamaForCausalLM``): the llama variant with one bias setting for attention and MLP.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds, refuse
from pipeline.hf.architectures.decoder import decoder_config_from_hf, decoder_config_to_hf

LLAMA_ARCH = "LlamaForCausalLM"


def _llama_config_to_hf(config: GPTConfig) -> dict:
    return dict(decoder_config_to_hf(config), attention_bias=config.bias, mlp_bias=config.bias)


def _llama_config_from_hf(cfg, source: str) -> dict:
    attention_bias, mlp_bias = bool(cfg.attention_bias), bool(getattr(cfg, "mlp_bias", False))
    if attention_bias != mlp_bias:
        refuse(source, "attention_bias/mlp_bias", (attention_bias, mlp_bias),
                "one bias setting for attention and MLP alike")
    return dict(decoder_config_from_hf(cfg, source), bias=attention_bias)


FAMILY = HFFamily(
    model_type="llama", variant="llama", config_class="LlamaConfig", architecture=LLAMA_ARCH,
    classifier="LlamaForSequenceClassification", base="LlamaModel",
    read=_llama_config_from_hf, write=_llama_config_to_hf,
    holds=holds())
