"""Mixtral (``MixtralForCausalLM``): Mistral's attention, every layer a mixture of SwiGLU experts.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, holds, refuse
from pipeline.hf.architectures.decoder import decoder_config_to_hf
from pipeline.hf.architectures.mistral import mistral_config_from_hf
from pipeline.hf.experts import MIXTRAL_EXPERTS


def _mixtral_config_to_hf(config: GPTConfig) -> dict:
    default_head = config.head_dim == config.hidden_size // config.num_heads  # MixtralConfig keeps None there
    return dict(decoder_config_to_hf(config), sliding_window=config.sliding_window,
                head_dim=None if default_head else config.head_dim,
                intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                num_local_experts=config.num_experts, num_experts_per_tok=config.moe_top_k,
                router_aux_loss_coef=config.moe_aux_loss_coeff, router_jitter_noise=0.0)


def _mixtral_config_from_hf(cfg, source: str) -> dict:
    """Mixtral: Mistral's attention, every layer a mixture of ``num_local_experts`` SwiGLU experts (routing:
    softmax, top-k, renormalised; dropless), the load-balancing loss ``router_aux_loss_coef``."""
    if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        refuse(source, "router_jitter_noise", cfg.router_jitter_noise, "0 (no multiplicative jitter)")
    return dict(mistral_config_from_hf(cfg, source), num_experts=cfg.num_local_experts,
                moe_top_k=cfg.num_experts_per_tok, moe_ffn_hidden_size=cfg.intermediate_size,
                moe_aux_loss_coeff=float(cfg.router_aux_loss_coef), moe_norm_topk_prob=True, moe_layer_freq=1)


FAMILY = HFFamily(
    model_type="mixtral", variant="llama", config_class="MixtralConfig", architecture="MixtralForCausalLM",
    classifier="MixtralForSequenceClassification", base="MixtralModel",
    read=_mixtral_config_from_hf, write=_mixtral_config_to_hf,
    holds=holds(sliding_window=True, bias=False, moe=True),
    experts=MIXTRAL_EXPERTS)
