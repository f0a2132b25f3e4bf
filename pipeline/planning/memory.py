"""Memory per GPU: model states by ZeRO stage (as DeepSpeed 0.19.8 keeps them) and activations by
recomputation policy (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").

Model states, bytes per parameter of the GPU's share ``psi`` (TP and PP split first), over ``N_d`` DP ranks:

    precision   weights  gradients  optimizer (Adam)
    bf16/fp16   2        2          12 (fp32 master, m, v)
    fp32        4        4          8  (m, v)

ZeRO-0 keeps all of them; ZeRO-1 partitions the optimizer states and, as DeepSpeed 0.19.8 does (it reduces the
gradients bucket by bucket in the backward and keeps only its own partition, bench/zero_memory.py), the
gradients; ZeRO-2 the same; ZeRO-3 the weights too. DeepSpeed's communication buckets come on top (not
counted: 1% of the model in the measurement, ``reduce_bucket_size`` elements on a cluster).

Activations of one layer for one micro-batch of ``b`` sequences of ``s`` tokens, 2-byte activations
(Korthikanti's section 4, generalised to grouped-query attention and SwiGLU, and to dropout being off):

    replicated across TP unless SP:   2 norm inputs 4sbh, QKV and MLP inputs 4sbh, 2 dropout masks 2sbh
    split by TP:                      Q 2sbq, K and V 4sb kv, projection input 2sbq, MLP: 4sbf (GELU) or 6sbf
                                      (SwiGLU)
    attention scores, split by TP:    softmax 2as^2b, its dropout mask and output 3as^2b; a fused kernel
                                      (``ModelShape.fused_attention``, the default) keeps only its fp32
                                      log-sum-exp 4asb and none of these
    gpt2 (q = kv = h, f = 4h):        sbh (10 + 24/t + 5as/(ht)), or sbh (34/t + 5as/(ht)) with SP

``selective`` recomputes its ``recompute_modules`` (Megatron-Core's names) and keeps the rest of the layer; what each
no longer keeps, in the terms above (``recompute_savings``):

    core_attn    the attention scores, 5as^2b/t (2as^2b/t without attention dropout); with a fused kernel
                 only the log-sum-exp 4asb/t (its inputs Q, K, V are kept by the checkpoint, its output by the
                 projection): nothing worth its recomputation, as the H200 measurement shows
    mlp_act      the second MLP linear's input, 2sbf/t (the paper's 8sbh/t for gpt2's f = 4h; SwiGLU's
                 silu(gate) * up the same); the activation's input (the first linear's output) is kept
    mlp          the whole dense MLP in a checkpoint keeping its input: the first linear's output and the
                 activation's, 4sbf/t (SwiGLU: 6sbf/t, gate and up); not with mlp_act, which it includes
    layernorm    the QKV and first MLP linear's inputs (the norms' outputs), 4sbh (/t with SP); the norms'
                 inputs are kept
    (mlp_act and layernorm by output-discarding recomputation, models/recompute.py: a plain checkpoint of
    them would keep their outputs as the next matmul's inputs and save nothing)

``full`` keeps each layer's input (2sbh, /t with SP) and rebuilds one layer at a time in the backward. The first
pipeline stage holds ``min(m, p)`` micro-batches of its ``L/p`` layers under 1F1B: ``L`` layers' worth once
``m >= p``. The output layer's fp32 softmax over [b, s, V/t] (what the project's vocab-parallel cross-entropy saves)
is added on the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

POLICIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp_act", "layernorm")  # models.gpt's, in this order
SELECTIVE_DEFAULT = ("core_attn",)  # Megatron-Core's default recompute_modules
PRECISION_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # weights, grads, optimizer


@dataclass(frozen=True)
class ModelStates:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_states(psi: float, zero: int, dp: int, precision: str = "bf16") -> ModelStates:
    """Bytes per GPU of the weights, gradients and optimizer states of ``psi`` parameters."""
    w, g, o = PRECISION_BYTES[precision]
    return ModelStates(weights=w * psi / (dp if zero >= 3 else 1), gradients=g * psi / (dp if zero >= 1 else 1),
                       optimizer=o * psi / (dp if zero >= 1 else 1))


def layer_activation_terms(m: ModelShape, b: int) -> tuple[float, float, float]:
    """(replicated, split, scores) bytes of one layer's activations for ``b`` sequences, 2-byte activations."""
    if m.recurrent:  # per step the gates (4H), cell and hidden states (2H), fp32 cell: ~ 8 sbH x 2 bytes
        return 0.0, 16.0 * m.seq * b * m.hidden, 0.0
    s, h = m.seq, m.hidden
    q, kv, f = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
    replicated = s * b * (4 * h + 4 * h + (2 * h if m.hidden_dropout else 0))
    split = s * b * (2 * q + 4 * kv + 2 * q + (6 if m.gated_mlp else 4) * f)
    scores = m.heads * s * b * (4 if m.fused_attention else s * (5 if m.attention_dropout else 2))
    return float(replicated), float(split), float(scores)


def recompute_savings(m: ModelShape, b: int, tp: int, sp: bool, modules=SELECTIVE_DEFAULT) -> float:
    """Bytes of one layer's activations (2-byte) that selective recomputation of ``modules`` does not keep."""
    if m.recurrent:
        return 0.0
    _, _, scores = layer_activation_terms(m, b)
    saved = {"core_attn": scores / tp, "mlp_act": 2.0 * m.seq * b * m.ffn / tp,
             "mlp": (6.0 if m.gated_mlp else 4.0) * m.seq * b * m.ffn / tp,
             "layernorm": 4.0 * m.seq * b * m.hidden / (tp if sp else 1)}
    return sum(saved.get(name, 0.0) for name in modules)  # moe_act: the planner does not plan MoE layers


def layer_activations(m: ModelShape, b: int, tp: int, sp: bool, policy: str, modules=SELECTIVE_DEFAULT) -> float:
    rep, split, scores = layer_activation_terms(m, b)
    if policy == "full":
        return 2.0 * m.seq * b * m.hidden / (tp if sp else 1)
    kept = rep / (tp if sp else 1) + split / tp + scores / tp
    return kept - (recompute_savings(m, b, tp, sp, modules) if policy == "selective" else 0.0)


def activations(m: ModelShape, b: int, tp: int, pp: int, sp: bool, policy: str, micro_batches: int,
                precision: str = "bf16", modules=SELECTIVE_DEFAULT) -> float:
    """Peak activation bytes on one GPU of the fullest stage."""
    scale = PRECISION_BYTES[precision][0] / 2
    layers_per_stage = -(-m.layers // pp)
    in_flight = min(micro_batches, pp)
    held = in_flight * layers_per_stage * layer_activations(m, b, tp, sp, policy, modules)
    if policy == "full":  # the layer rebuilt in the backward
        held += layer_activations(m, b, tp, sp, "none" if m.recurrent else "selective")
    logits = (4.0 / scale) * m.seq * b * m.vocab / tp  # fp32 softmax saved by the cross-entropy
    last_stage = layers_per_stage * layer_activations(m, b, tp, sp, policy, modules) + logits
    return scale * max(held, last_stage if pp > 1 else held + logits)
