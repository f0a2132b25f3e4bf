"""Mixture-of-experts MLP: the project's MLPs as experts inside DeepSpeed's ``deepspeed.moe.layer.MoE``.

DeepSpeed gives the expert container (``Experts``, whose parameters it keeps out of the data-parallel
all-reduce and saves per expert), the dispatch to capacity slots and the all-to-all over the expert-parallel
group. Its gate is replaced by ``ReferenceGate`` (a ``TopKGate`` with the same ``wg`` router weight and the
same return value), because DeepSpeed 0.19's gates do not route as Mixtral or Qwen3-MoE do:

* ``top1gating`` (k=1) does not renormalise the chosen expert's weight (Switch's ``p``; Mixtral's is 1.0) and
  draws Random Token Selection noise by default; ``top2gating`` (k=2) renormalises over the two experts, as
  Mixtral, but samples the second expert with Gumbel noise unless ``top2_2nd_expert_sampling`` is off;
  ``topkgating`` (k>2) renormalises; none of them can leave the weights unnormalised (Qwen3-MoE's
  ``norm_topk_prob=False``);
* the load-balancing loss counts only the first choice (k=2) or divides by k (k>2), where Mixtral's
  (``load_balancing_loss_func``) counts every one of the top-k choices.

``ReferenceGate``: softmax over all experts in fp32, top-k, the top-k weights renormalised (``norm_topk_prob``),
the Switch/GShard loss ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of tokens having expert ``e`` among
their top-k (Mixtral's ``load_balancing_loss_func``: the f_e sum to k) and ``P_e`` the mean router
probability, an optional router z-loss (ST-MoE), and, with a capacity factor, tokens dropped in token order
once an expert's ``max(min_capacity, ceil(k * tokens / E * capacity_factor))`` slots are full (dropless: none).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .parallel import get_parallel_state


def is_moe_layer(config: GPTConfig, index: int) -> bool:
    """Whether layer ``index`` (0-based) has experts (``GPTConfig.is_moe_layer``)."""
    return config.is_moe_layer(index)


class ExpertMLP(nn.Module):
    """One expert: the project's MLP (SwiGLU for llama, GELU-tanh for gpt2), whole on every rank (the experts
    are not split by tensor parallelism). ``fc_in`` holds [gate; up] as the dense MLP's does."""

    def __init__(self, config: GPTConfig, ffn: int):
        super().__init__()
        self.gated = config.variant == "llama"
        h = config.hidden_size
        self.fc_in = nn.Linear(h, 2 * ffn if self.gated else ffn, bias=config.bias)
        self.fc_out = nn.Linear(ffn, h, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.fc_out(F.silu(gate) * up)
        return self.fc_out(F.gelu(h, approximate="tanh"))


def _topk_gate_class():
    from deepspeed.moe.sharded_moe import TopKGate  # noqa: PLC0415  (DeepSpeed only where an MoE is built)
    return TopKGate


def route(logits: torch.Tensor, k: int, normalize: bool, capacity_factor: float | None, min_capacity: int):
    """The routing of [tokens, E] router logits: (top-k weights [S, k], expert indices [S, k], slot of each route
    in its expert's buffer [S, k], kept [S, k], capacity, load-balancing loss, z-loss, tokens per expert [E])."""
    probs = F.softmax(logits.float(), dim=-1)
    S, E = probs.shape
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    mask = F.one_hot(experts, E)                                     # [S, k, E]
    counts = mask.sum(dim=(0, 1))
    l_aux = E * torch.sum(mask.float().mean(dim=0).sum(dim=0) * probs.mean(dim=0))
    z_loss = torch.logsumexp(logits.float(), dim=-1).square().mean()
    # slots in token order, choice order within a token (the first choice of token t before its second)
    locations = (torch.cumsum(mask.reshape(S * k, E), dim=0) - 1).reshape(S, k, E)
    locations = (locations * mask).sum(-1)                           # [S, k]
    if capacity_factor is None:
        capacity = int(counts.max())
    else:
        capacity = max(min_capacity, math.ceil(k * S / E * capacity_factor))
    kept = locations < capacity
    return weights, experts, locations, kept, capacity, l_aux, z_loss, counts


class ReferenceGate(nn.Module):
    """Built by ``make_gate`` as a subclass of DeepSpeed's ``TopKGate``: the router ``wg`` and the sparse-route
    return of ``TopKGate.forward`` (what ``MOELayer`` reads), with the reference models' routing."""

    def setup(self, config: GPTConfig):
        self.k = config.moe_top_k
        self.normalize = config.moe_norm_topk_prob
        self.capacity = config.moe_capacity_factor
        self.min_capacity = config.moe_min_capacity
        self.z_loss = None
        self.dropped_fraction = None

    def forward(self, input, used_token=None, sparse_routes=True, use_tutel=False):
        if not sparse_routes or use_tutel or used_token is not None:
            raise ValueError("ReferenceGate gives sparse routes only (no Tutel, no used_token)")
        logits = F.linear(input.float(), self.wg.weight.float())
        factor = self.capacity if self.training else None  # evaluation is dropless
        weights, experts, locations, kept, capacity, l_aux, z_loss, counts = route(
            logits, self.k, self.normalize, factor, self.min_capacity)
        capacity_t = torch.tensor(capacity, device=logits.device)
        if factor is None and self.ep_group is not None and torch.distributed.get_world_size(self.ep_group) > 1:
            torch.distributed.all_reduce(capacity_t, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
        self.z_loss = z_loss
        self.dropped_fraction = (1.0 - kept.float().mean()).detach()
        indices = torch.where(kept, experts, torch.full_like(experts, -1))
        gates = weights * kept
        if self.normalize and factor is not None:  # renormalised over the routes kept, as DeepSpeed's
            gates = gates / gates.sum(-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        return (l_aux, capacity_t, logits.shape[1], indices.t().contiguous().to(torch.int32),
                (locations * kept).t().contiguous().to(torch.int32), gates.t().contiguous(), counts.detach())


def make_gate(config: GPTConfig) -> nn.Module:
    cls = type("ReferenceTopKGate", (ReferenceGate, _topk_gate_class()), {})
    gate = cls(config.hidden_size, config.num_experts, k=config.moe_top_k, min_capacity=config.moe_min_capacity,
               drop_tokens=config.moe_capacity_factor is not None, use_rts=False, top2_2nd_expert_sampling=False)
    gate.setup(config)
    return gate


class MoEMLP(nn.Module):
    """The MLP of an MoE layer: ``moe`` is DeepSpeed's ``MoE`` (its experts ``ExpertMLP``s, its gate a
    ``ReferenceGate``). After each forward, ``aux_loss`` holds coeff x load-balancing loss (+ z-loss coeff x
    z-loss), with its graph, for ``GPT.forward`` to add to the loss; ``exp_counts`` the tokens per expert."""

    def __init__(self, config: GPTConfig, init_std: float, out_std: float):
        super().__init__()
        from deepspeed.moe.layer import MoE  # noqa: PLC0415
        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        self.moe = MoE(config.hidden_size, ExpertMLP(config, ffn), num_experts=config.num_experts,
                       ep_size=config.moe_expert_parallel, k=config.moe_top_k,
                       capacity_factor=config.moe_capacity_factor or 1.0,
                       min_capacity=config.moe_min_capacity, drop_tokens=config.moe_capacity_factor is not None,
                       use_rts=False, top2_2nd_expert_sampling=False)
        self.moe.deepspeed_moe.gate = make_gate(config)
        self.coeff, self.z_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.aux_loss = None
        self.exp_counts = None
        self.stat_sums = None  # [tokens per expert..., dropped routes, routes, aux loss, forwards] (training)
        self._init_experts(config, init_std, out_std)
        nn.init.normal_(self.moe.deepspeed_moe.gate.wg.weight, std=init_std)

    def _init_experts(self, config: GPTConfig, init_std: float, out_std: float) -> None:
        """DeepSpeed deep-copies one expert: every expert gets its own draw. Every rank draws all
        ``num_experts`` in global order and keeps its own (``ep_rank x local + i``), so that the weights and
        the RNG stream after them are the same at every expert-parallel size."""
        local = self.moe.deepspeed_moe.experts.deepspeed_experts
        # DeepSpeed's expert groups (TP 1): consecutive data-parallel ranks, its rank there = dp rank mod EP
        first = get_parallel_state().get_data_parallel_rank() % config.moe_expert_parallel * len(local)
        self.first_expert = first  # the global index of local expert 0 (expert_slice)
        for e in range(config.num_experts):
            ours = local[e - first] if first <= e < first + len(local) else None
            for lin, std in (("fc_in", init_std), ("fc_out", out_std)):
                weight = getattr(ours or local[0], lin).weight
                drawn = nn.init.normal_(torch.empty_like(weight), std=std)
                if ours is not None:
                    with torch.no_grad():
                        weight.copy_(drawn)
        for expert in local:
            for lin in (expert.fc_in, expert.fc_out):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, self.exp_counts = self.moe(x)
        gate = self.moe.deepspeed_moe.gate
        self.aux_loss = self.coeff * l_aux + (self.z_coeff * gate.z_loss if self.z_coeff else 0.0)
        if self.training:  # summed over the training forwards until moe_step_stats reads them
            routes, dropped = self.exp_counts.sum(), gate.dropped_fraction * self.exp_counts.sum()
            sums = torch.cat([self.exp_counts.float(), torch.stack([dropped, routes, self.aux_loss.detach(),
                                                                    torch.ones_like(routes)]).float()])
            self.stat_sums = sums if self.stat_sums is None else self.stat_sums + sums
        return out


_EXPERT_INDEX = re.compile(r"(?<=\.deepspeed_experts\.)(\d+)(?=\.)")


@dataclass(frozen=True)
class ExpertSlice:
    """This rank's experts among an MoE layer's: local expert i is global expert ``first + i`` (of ``count``
    here). A full state dict names every expert by its global index; the model's parameters by the local one."""
    first: int = 0
    count: int = 0

    def full_name(self, name: str) -> str:
        """The full state dict's name of this rank's parameter ``name``."""
        return _EXPERT_INDEX.sub(lambda m: str(self.first + int(m.group(1))), name) if self.first else name

    def holds(self, full_name: str) -> bool:
        """Whether this rank has the tensor ``full_name`` of a full state dict (another rank's expert: no)."""
        m = _EXPERT_INDEX.search(full_name)
        return m is None or not self.count or self.first <= int(m.group(1)) < self.first + self.count


def expert_slice(model: nn.Module) -> ExpertSlice:
    """The experts of this rank (every MoE layer splits its experts alike); ExpertSlice() for a dense model."""
    for m in model.modules():
        if isinstance(m, MoEMLP):
            return ExpertSlice(m.first_expert, len(m.moe.deepspeed_moe.experts.deepspeed_experts))
    return ExpertSlice()


def moe_step_stats(model: nn.Module, group=None) -> dict:
    """The MoE layers' routing since the last call, summed over ``group`` (the data-parallel ranks): per layer
    the tokens per expert (DeepSpeed's exp_counts: top-k routes, before any drop), the max/mean load ratio and
    the fraction of routes dropped by the capacity; the mean auxiliary loss (coeff x loss, summed over layers).
    Empty for a dense model."""
    record, aux = {}, 0.0
    for i, mlp in enumerate(m for m in model.modules() if isinstance(m, MoEMLP)):
        if mlp.stat_sums is None:
            continue
        sums, mlp.stat_sums = mlp.stat_sums, None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(sums, group=group)
        counts, (dropped, routes, aux_sum, forwards) = sums[:-4], sums[-4:].tolist()
        record[f"moe_tokens_per_expert_{i}"] = [int(c) for c in counts.tolist()]
        record[f"moe_load_ratio_{i}"] = float(counts.max() / counts.mean().clamp(min=1e-9))
        record[f"moe_dropped_fraction_{i}"] = dropped / max(routes, 1.0)
        aux += aux_sum / forwards
    if record:
        record["moe_aux_loss"] = aux
    return record
