"""The routing of a mixture of experts, as the reference models compute it: which experts each token goes to, with
which weights, and the balancing (an auxiliary loss, or DeepSeek-V3's auxiliary-loss-free per-expert bias).

Scores are the router logits' softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3), in fp32. With groups
(DeepSeek-V3's ``n_group`` / ``topk_group``, Megatron-Core's ``moe_router_num_groups`` / ``moe_router_group_topk``)
the experts are split into ``num_groups`` consecutive groups, each group scored by the sum of its two best
experts, and a token's top-k come only from its ``group_topk`` best groups (``DeepseekV3TopkRouter``). A
balancing bias is added to the scores for the selection only: the weights are the scores themselves,
renormalised over the top-k if asked, times ``scaling`` (``routed_scaling_factor``).

The bias moves by ``rate x sign(mean load - load)`` from the tokens each expert received since its last update
(DeepSeek-V3, section 2.1.2; Megatron-Core's ``get_updated_expert_bias``), the counts summed over every rank that
routed other tokens, so that each rank computes the same bias.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..parallel import cp_world_size, reduce_from_context_parallel_region

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass(frozen=True)
class RouterPolicy:
    """How scores are made and experts chosen beyond top-k (the defaults: Mixtral's softmax top-k)."""
    score_function: str = "softmax"
    num_groups: int = 1              # 1: no group limit
    group_topk: int = 1              # groups a token's experts may come from
    scaling: float = 1.0             # routed_scaling_factor
    load_balancing: str = "aux_loss"  # aux_loss (over the batch), seq_aux_loss (per sequence), none

    @classmethod
    def from_config(cls, config) -> "RouterPolicy":
        return cls(config.moe_router_score_function, config.moe_router_num_groups or 1,
                   config.moe_router_group_topk or 1, config.moe_router_topk_scaling_factor,
                   config.moe_router_load_balancing_type)


def expert_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """[tokens, E] scores in fp32 from router logits."""
    if score_function == "sigmoid":
        return logits.float().sigmoid()
    return F.softmax(logits.float(), dim=-1)


def group_mask(scores: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """[tokens, E] True for the experts of each token's ``group_topk`` best groups (a group scores the sum of its
    two best experts' ``scores``, as DeepseekV3TopkRouter)."""
    S, E = scores.shape
    grouped = scores.view(S, num_groups, E // num_groups)
    group_scores = grouped.topk(min(2, E // num_groups), dim=-1)[0].sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return chosen.unsqueeze(-1).expand_as(grouped).reshape(S, E)


def select_experts(scores: torch.Tensor, k: int, policy: RouterPolicy, normalize: bool,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [S, k] before ``policy.scaling``, experts [S, k]): the top-k of ``scores + bias`` (within the best
    groups), weighted by their unbiased scores, renormalised over the k if ``normalize``."""
    choice = scores if bias is None else scores + bias.float()
    if policy.num_groups > 1:
        choice = choice.masked_fill(~group_mask(choice, policy.num_groups, policy.group_topk), float("-inf"))
    if bias is None and policy.num_groups == 1:
        weights, experts = torch.topk(scores, k, dim=-1)
    else:
        experts = torch.topk(choice, k, dim=-1)[1]
        weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if policy.score_function == "sigmoid" else 0))
    return weights, experts


def balance_loss(scores: torch.Tensor, experts: torch.Tensor, policy: RouterPolicy,
                 sequence_length: int | None = None) -> torch.Tensor:
    """``aux_loss``: the Switch/GShard loss ``E * sum_e f_e P_e`` over the batch (Mixtral's
    ``load_balancing_loss_func``: ``f_e`` the fraction of tokens having ``e`` among their top-k, summing to k;
    ``P_e`` the mean score, sigmoid scores normalised per token first). ``seq_aux_loss``: DeepSeek-V3's
    sequence-wise loss (its equations 17-20), ``(E / k) * sum_e f_e P_e`` within each sequence of
    ``sequence_length`` tokens, averaged over the sequences (Megatron-Core's divides by k as well). ``experts``:
    each token's top-k [S, k]."""
    (S, k), E = experts.shape, scores.shape[-1]
    probs = scores / scores.sum(dim=-1, keepdim=True) if policy.score_function == "sigmoid" else scores
    chosen = torch.zeros_like(probs).scatter_(1, experts, 1.0)  # [S, E]: 1 where e is in the token's top-k
    # means over whole sequences: under context parallelism each rank holds an equal chunk of every sequence, the
    # sums go over the context group (each rank's gradient stays its own tokens', as the loss's)
    chunks = cp_world_size()
    if policy.load_balancing != "seq_aux_loss":
        tokens = S * chunks
        routed = reduce_from_context_parallel_region(chosen.sum(dim=0)) / tokens
        return E * torch.sum(routed * reduce_from_context_parallel_region(probs.sum(dim=0)) / tokens)
    chosen = chosen.view(-1, sequence_length or S, E)
    probs = probs.view(chosen.shape)
    length = chosen.shape[1] * chunks
    routed = reduce_from_context_parallel_region(chosen.sum(dim=1)) / length
    return E / k * torch.sum(routed * reduce_from_context_parallel_region(probs.sum(dim=1)) / length, dim=-1).mean()


def updated_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean load - load)`` (fp32): underloaded experts become likelier, overloaded ones less."""
    load = load.float()
    return bias + rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
