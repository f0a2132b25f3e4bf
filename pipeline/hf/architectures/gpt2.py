"""GPT-2 (``GPT2LMHeadModel``): the project's gpt2 variant, its Conv1D weights transposed, its biases always there.
"""
from __future__ import annotations

from models.config import GPTConfig
from pipeline.hf.architectures.base import (HFFamily, WeightLayout, WeightRule, later_generation,
                                              refuse)


GPT2_ARCH = "GPT2LMHeadModel"
# Activations computing exactly the project's GELU (tanh approximation): the formula and torch's kernel.
TANH_GELUS = {"gelu_new", "gelu_pytorch_tanh"}


def _gpt2_map(c: GPTConfig) -> list[WeightRule]:
    h, f, V = c.hidden_size, c.ffn_hidden_size, c.vocab_size
    R = WeightRule
    rules = [R("embedding.word_embeddings.weight", (V, h), ("transformer.wte.weight",)),
             R("embedding.position_embeddings.weight", (c.max_position_embeddings, h), ("transformer.wpe.weight",))]
    for i in range(c.num_layers):
        p, t = f"layers.{i}.", f"transformer.h.{i}."
        rules += [R(p + "input_norm.weight", (h,), (t + "ln_1.weight",)),
                  R(p + "input_norm.bias", (h,), (t + "ln_1.bias",)),
                  R(p + "attention.qkv.weight", (3 * h, h), (t + "attn.c_attn.weight",), transpose=True),
                  R(p + "attention.dense.weight", (h, h), (t + "attn.c_proj.weight",), transpose=True),
                  R(p + "post_attention_norm.weight", (h,), (t + "ln_2.weight",)),
                  R(p + "post_attention_norm.bias", (h,), (t + "ln_2.bias",)),
                  R(p + "mlp.fc_in.weight", (f, h), (t + "mlp.c_fc.weight",), transpose=True),
                  R(p + "mlp.fc_out.weight", (h, f), (t + "mlp.c_proj.weight",), transpose=True)]
        if c.bias:
            rules += [R(p + "attention.qkv.bias", (3 * h,), (t + "attn.c_attn.bias",)),
                      R(p + "attention.dense.bias", (h,), (t + "attn.c_proj.bias",)),
                      R(p + "mlp.fc_in.bias", (f,), (t + "mlp.c_fc.bias",)),
                      R(p + "mlp.fc_out.bias", (h,), (t + "mlp.c_proj.bias",))]
    rules += [R("final_norm.norm.weight", (h,), ("transformer.ln_f.weight",)),
              R("final_norm.norm.bias", (h,), ("transformer.ln_f.bias",))]
    return rules


def gpt2_bias_names(c: GPTConfig) -> dict[str, int]:
    """GPT-2's Conv1D always has a bias: a bias-free project model exports zeros there (exactly the same function)."""
    h, f = c.hidden_size, c.ffn_hidden_size
    out = {}
    for i in range(c.num_layers):
        t = f"transformer.h.{i}."
        out.update({t + "attn.c_attn.bias": 3 * h, t + "attn.c_proj.bias": h, t + "mlp.c_fc.bias": f,
                    t + "mlp.c_proj.bias": h})
    return out


def _gpt2_config_to_hf(config: GPTConfig) -> dict:
    return dict(
        vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_hidden_size,
        activation_function="gelu_new", resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.norm_eps,
        initializer_range=config.init_std, tie_word_embeddings=True)


def _gpt2_config_from_hf(cfg, source: str) -> dict:
    act = cfg.activation_function
    if act not in TANH_GELUS:
        refuse(source, "activation_function", act, "it uses GELU with the tanh approximation: gelu_new")
    if not getattr(cfg, "scale_attn_weights", True):
        refuse(source, "scale_attn_weights", False, "attention scores are always scaled by 1/sqrt(head_dim)")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        refuse(source, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if getattr(cfg, "add_cross_attention", False):
        refuse(source, "add_cross_attention", True, "a decoder-only model")
    if getattr(cfg, "tie_word_embeddings", True) is False:
        refuse(source, "tie_word_embeddings", False, "the gpt2 variant ties input and output embeddings")
    return dict(variant="gpt2", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_layers=cfg.n_layer,
                num_heads=cfg.n_head, ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd,
                max_position_embeddings=cfg.n_positions, norm_eps=float(cfg.layer_norm_epsilon),
                hidden_dropout=float(cfg.resid_pdrop), attention_dropout=float(cfg.attn_pdrop),
                init_std=float(cfg.initializer_range), bias=True, tie_embeddings=True)


def _bias_recorded(cfg, training: dict) -> dict:
    """An export of a bias-free model records it (its zero biases are GPT-2's): imported bias-free again, once
    ``from_hf`` has checked the biases are still zero."""
    return {"bias": training.get("bias", True) is not False}


WEIGHTS = WeightLayout(lambda c, experts: _gpt2_map(c), "transformer.", "transformer.wte.weight", gpt2_bias_names)


def _holds(c: GPTConfig) -> str | None:
    return (f"num_experts={c.num_experts} (GPT-2 has no MoE layers)" if c.num_experts
            else ", ".join(later_generation(c)) or None)


FAMILY = HFFamily(
    model_type="gpt2", variant="gpt2", config_class="GPT2Config", architecture=GPT2_ARCH,
    classifier="GPT2ForSequenceClassification", base="GPT2Model",
    read=_gpt2_config_from_hf, write=_gpt2_config_to_hf,
    holds=_holds,
    imported=_bias_recorded)
