"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): latent attention, sigmoid routing with the balancing bias, shared
experts, the first layers dense, multi-token prediction depths.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import HFFamily, differs, refuse
from pipeline.hf.architectures.decoder import decoder_config_from_hf, decoder_config_to_hf, rope_interleaved
from pipeline.hf.experts import DEEPSEEK_V3_EXPERTS


def _deepseek_v3_config_to_hf(c: GPTConfig) -> dict:
    out = dict(decoder_config_to_hf(c), moe_intermediate_size=c.moe_ffn_hidden_size or c.ffn_hidden_size,
               n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_top_k, n_group=c.moe_router_num_groups or 1,
               topk_group=c.moe_router_group_topk or 1, routed_scaling_factor=c.moe_router_topk_scaling_factor,
               norm_topk_prob=c.moe_norm_topk_prob, first_k_dense_replace=len(c.moe_dense_layers),
               n_shared_experts=c.moe_shared_expert_intermediate_size // (c.moe_ffn_hidden_size or c.ffn_hidden_size),
               q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
               qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope_interleave=rope_interleaved(c),
               attention_bias=False, num_mtp_layers=c.mtp_num_layers)
    del out["head_dim"]  # DeepseekV3Config derives it (qk_rope_head_dim)
    return out


# DeepSeek-V3's training settings that its config has no field for (docs/moe.md): the sequence-wise balancing loss
# with the paper's alpha, beside the auxiliary-loss-free bias (its gamma is the project's default rate)
DEEPSEEK_V3_TRAINING = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)


def _deepseek_v3_config_from_hf(cfg, source: str) -> dict:
    """DeepSeek-V3: latent attention (``q_lora_rank``, ``kv_lora_rank``, the head dims), the first
    ``first_k_dense_replace`` layers dense, the others ``n_routed_experts`` experts of ``moe_intermediate_size``
    chosen by sigmoid scores within the ``topk_group`` best of ``n_group`` groups, the selection moved by the
    balancing bias (``e_score_correction_bias``), weights renormalised if ``norm_topk_prob`` and scaled by
    ``routed_scaling_factor``, beside ``n_shared_experts`` shared experts (one MLP of n x the experts' width);
    ``num_mtp_layers`` prediction depths (those the files hold: ``from_hf``)."""
    if getattr(cfg, "attention_bias", False):
        refuse(source, "attention_bias", True, "latent attention without biases")
    if not cfg.n_shared_experts:
        refuse(source, "n_shared_experts", cfg.n_shared_experts, "a DeepSeek-V3 layer with its shared experts")
    groups = cfg.n_group if (cfg.n_group or 1) > 1 else None
    return dict(decoder_config_from_hf(cfg, source), **DEEPSEEK_V3_TRAINING, bias=False,
                num_kv_heads=cfg.num_attention_heads, head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                num_experts=cfg.n_routed_experts, moe_top_k=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_dense_layers=list(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers))),
                moe_norm_topk_prob=bool(cfg.norm_topk_prob), moe_router_score_function="sigmoid",
                moe_router_num_groups=groups, moe_router_group_topk=cfg.topk_group if groups else None,
                moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor), moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
                multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, mtp_num_layers=int(getattr(cfg, "num_mtp_layers", 0) or 0))


def _deepseek_v3_holds(c: GPTConfig) -> str | None:
    """DeepSeek-V3: latent attention, sigmoid routing with the balancing bias, ungated shared experts n x the
    experts' width, the first layers dense (any group limit, scaling, renormalisation and MTP depths)."""
    lacks = differs(c, (("multi_latent_attention", True), ("moe_router_score_function", "sigmoid"),
                         ("moe_router_enable_expert_bias", True), ("moe_shared_expert_gate", False),
                         ("qk_norm", False), ("qkv_bias", False), ("bias", False), ("sliding_window", None),
                         ("moe_layer_freq", 1)))
    if not c.num_experts:
        return ", ".join(lacks + ["num_experts=0"])
    if c.moe_dense_layers != list(range(len(c.moe_dense_layers))):
        lacks.append(f"moe_dense_layers={c.moe_dense_layers} (only the first layers dense: first_k_dense_replace)")
    shared, f = c.moe_shared_expert_intermediate_size, c.moe_ffn_hidden_size or c.ffn_hidden_size
    if shared is None or shared % f:
        lacks.append(f"moe_shared_expert_intermediate_size={shared} (n_shared_experts x the experts' {f})")
    return ", ".join(lacks) or None


def _rope_recorded(cfg) -> dict:
    """The layout of the RoPE rows in the files (``decoder.rope_interleaved``), for the export back."""
    return {"rope_interleave": bool(getattr(cfg, "rope_interleave", True))}


FAMILY = HFFamily(
    model_type="deepseek_v3", variant="llama", config_class="DeepseekV3Config", architecture="DeepseekV3ForCausalLM",
    classifier="DeepseekV3ForSequenceClassification", base="DeepseekV3Model",
    read=_deepseek_v3_config_from_hf, write=_deepseek_v3_config_to_hf,
    holds=_deepseek_v3_holds,
    experts=DEEPSEEK_V3_EXPERTS, recorded=_rope_recorded)
