"""Mixtures of experts: the MoE layer inside DeepSpeed-MoE's containers (``layer``), its router (``router``: softmax
or sigmoid scores, group-limited top-k, balancing losses, the auxiliary-loss-free expert bias) and the local
experts' grouped matrix products (``grouped``)."""
from .layer import (EXPERT_INDEX, ExpertMLP, ExpertSlice, MoEMLP, ReferenceGate, SharedExpertMLP, dispatch,
                    expert_bias_gates, expert_slice, forget_expert_groups, gather_experts, is_balance_bias,
                    is_moe_layer, make_gate, moe_step_stats, register_expert_groups, route, update_expert_biases)

__all__ = ["EXPERT_INDEX", "ExpertMLP", "ExpertSlice", "MoEMLP", "ReferenceGate", "SharedExpertMLP", "dispatch",
           "expert_bias_gates", "expert_slice", "forget_expert_groups", "gather_experts", "is_balance_bias",
           "is_moe_layer", "make_gate", "moe_step_stats", "register_expert_groups", "route", "update_expert_biases"]
