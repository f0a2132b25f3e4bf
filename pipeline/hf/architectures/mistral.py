"""Mistral (``MistralForCausalLM``): the llama variant with one sliding window in every layer.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds
from pipeline.hf.architectures.decoder import decoder_config_from_hf, decoder_config_to_hf


def _mistral_config_to_hf(config: GPTConfig) -> dict:
    return dict(decoder_config_to_hf(config), sliding_window=config.sliding_window)


def mistral_config_from_hf(cfg, source: str) -> dict:
    # GPTConfig refuses a window shorter than the sequence length (full attention would not equal it there).
    return dict(decoder_config_from_hf(cfg, source), bias=False, sliding_window=cfg.sliding_window)


FAMILY = HFFamily(
    model_type="mistral", variant="llama", config_class="MistralConfig", architecture="MistralForCausalLM",
    classifier="MistralForSequenceClassification", base="MistralModel",
    read=mistral_config_from_hf, write=_mistral_config_to_hf,
    holds=holds(sliding_window=True, bias=False))
