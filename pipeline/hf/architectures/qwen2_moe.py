"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention, Qwen's MoE layers each with a gated shared expert.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import LATER_GENERATION, HFFamily, differs, refuse
from pipeline.hf.architectures.decoder import qwen_moe_fields_from_hf, qwen_moe_fields_to_hf
from pipeline.hf.architectures.qwen2 import qwen2_config_from_hf, qwen2_config_to_hf
from pipeline.hf.experts import QWEN2_MOE_EXPERTS


def _qwen2_moe_holds(c: GPTConfig) -> str | None:
    """Qwen2-MoE: Qwen2's attention, Qwen's softmax routing, a gated shared expert in every MoE layer."""
    wanted = {**LATER_GENERATION, "moe_shared_expert_gate": True, "qk_norm": False, "bias": False,
              "sliding_window": None}
    del wanted["moe_shared_expert_intermediate_size"]  # any width (the gate needs one)
    lacks = differs(c, wanted.items())
    return ", ".join(lacks + ([] if c.num_experts else ["num_experts=0"])) or None


def _qwen2_moe_config_to_hf(config: GPTConfig) -> dict:
    return dict(qwen2_config_to_hf(config), **qwen_moe_fields_to_hf(config), qkv_bias=config.qkv_bias,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)


def _qwen2_moe_config_from_hf(cfg, source: str) -> dict:
    """Qwen2-MoE: Qwen2's attention (Q, K, V biases if ``qkv_bias``), Qwen's MoE layers, each with a shared expert
    of ``shared_expert_intermediate_size`` whose output is scaled by sigmoid(``shared_expert_gate``(x))."""
    if not getattr(cfg, "shared_expert_intermediate_size", 0):
        refuse(source, "shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                "a Qwen2-MoE layer with its shared expert")
    return dict(qwen2_config_from_hf(cfg, source), **qwen_moe_fields_from_hf(cfg, source, "Qwen2"),
                qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
                moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, moe_shared_expert_gate=True)


FAMILY = HFFamily(
    model_type="qwen2_moe", variant="llama", config_class="Qwen2MoeConfig", architecture="Qwen2MoeForCausalLM",
    classifier="Qwen2MoeForSequenceClassification", base="Qwen2MoeModel",
    read=_qwen2_moe_config_from_hf, write=_qwen2_moe_config_to_hf,
    holds=_qwen2_moe_holds,
    experts=QWEN2_MOE_EXPERTS)
