"""Mixture-of-experts MLP: the project's MLPs as experts inside DeepSpeed's ``deepspeed.moe.layer.MoE``.

DeepSpeed gives the expert container (``Experts``, whose parameters it keeps out of the data-parallel
all-reduce and saves per expert), the expert-parallel groups and ``MOELayer``. Its forward is replaced by
``dispatch`` (each expert computes its routed tokens alone, not a buffer padded to one capacity) and its gate by
``ReferenceGate`` (a ``TopKGate`` with the same ``wg`` router weight), because DeepSpeed 0.19's gates do not
route as Mixtral or Qwen3-MoE do:

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

from ..config import GPTConfig
from ..feed_forward import FeedForward
from .grouped import grouped_experts, tiled_grouped_experts
from ..parallel import (ColumnParallelLinear, Layout, RowParallelLinear, collectives, cp_world_size,
                       gather_from_sequence_parallel_region, get_parallel_state, get_shard_spec, normal_init,
                       reduce_from_context_parallel_region, scatter_to_sequence_parallel_region, tp_rank,
                       tp_world_size)
from ..tiling import row_tiles, tiled_mlp
from ..parallel.sharding import set_shard_spec
from .router import RouterPolicy, balance_loss, expert_scores, select_experts, updated_expert_bias


def is_moe_layer(config: GPTConfig, index: int) -> bool:
    """Whether layer ``index`` (0-based) has experts (``GPTConfig.is_moe_layer``)."""
    return config.is_moe_layer(index)


class ExpertMLP(FeedForward):
    """One expert: the project's MLP (SwiGLU for llama, GELU-tanh for gpt2), its columns split over the TP ranks
    as the dense MLP's (DeepSpeed's ``enable_expert_tensor_parallelism``; docs/moe.md says why). ``fc_in`` holds
    [gate; up] as the dense MLP's does. Built with zero weights: ``MoEMLP`` draws every expert's.
    ``recompute_act``: Megatron-Core's ``moe_act``."""

    def __init__(self, config: GPTConfig, ffn: int, tiles: int = 1):
        super().__init__(gated=config.variant == "llama")
        self.tiles = tiles  # ALST's tiled MLP (--tiled-mlp): the expert's routed tokens in this many tiles
        h = config.hidden_size
        self.fc_in = ColumnParallelLinear(h, output_sizes=(ffn, ffn) if self.gated else (ffn,), bias=config.bias,
                                          init_method=nn.init.zeros_)
        self.fc_out = RowParallelLinear(ffn, h, bias=config.bias, input_is_parallel=True, init_method=nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = row_tiles(x.shape[0], self.tiles)  # [routed tokens, h]: TiledMLP takes expert rows as they are
        if tiles > 1:
            return tiled_mlp(FeedForward._compute, self, x, tiles)
        return super().forward(x)


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape, spec = list(param.shape), get_shard_spec(param)
    shape[spec.dim] = sum(spec.parts)
    return tuple(shape)


def _topk_gate_class():
    from deepspeed.moe.sharded_moe import TopKGate  # noqa: PLC0415  (DeepSpeed only where an MoE is built)
    return TopKGate


def route(logits: torch.Tensor, k: int, normalize: bool, capacity_factor: float | None, min_capacity: int,
          policy: RouterPolicy = RouterPolicy(), bias: torch.Tensor | None = None,
          sequence_length: int | None = None):
    """The routing of [tokens, E] router logits: (top-k weights [S, k] before ``policy.scaling``, expert indices
    [S, k], slot of each route in its expert's buffer [S, k] (None when dropless), kept [S, k], capacity,
    load-balancing loss, z-loss, tokens per expert [E]). ``policy``, ``bias``: models/moe/router.py (the bias
    moves the selection only); ``sequence_length``: the tokens of one sequence (the sequence-wise loss)."""
    probs = expert_scores(logits, policy.score_function)
    S, E = probs.shape
    weights, experts = select_experts(probs, k, policy, normalize, bias)
    counts = torch.bincount(experts.flatten(), minlength=E)
    # the losses' means over the whole sequence: under context parallelism each rank holds an equal chunk of it,
    # sums go over the context group (the gradient of each rank's own tokens stays its own, as the loss's)
    l_aux = balance_loss(probs, experts, policy, sequence_length)
    z_loss = (reduce_from_context_parallel_region(torch.logsumexp(logits.float(), dim=-1).square().sum())
              / (S * cp_world_size()))
    if capacity_factor is None:  # dropless: every route kept, no slot to find (the locations None)
        kept = torch.ones_like(experts, dtype=torch.bool)
        return weights, experts, None, kept, int(counts.max()), l_aux, z_loss, counts
    # slots in token order, choice order within a token (the first choice of token t before its second)
    mask = F.one_hot(experts, E)                                     # [S, k, E]
    locations = (torch.cumsum(mask.reshape(S * k, E), dim=0) - 1).reshape(S, k, E)
    locations = (locations * mask).sum(-1)                           # [S, k]
    capacity = max(min_capacity, math.ceil(k * S / E * capacity_factor))
    return weights, experts, locations, locations < capacity, capacity, l_aux, z_loss, counts


class ReferenceGate(nn.Module):
    """Built by ``make_gate`` as a subclass of DeepSpeed's ``TopKGate`` (its router ``wg``), with the reference
    models' routing (models/moe/router.py). Returns what ``dispatch`` reads: (load-balancing loss, expert of each route
    [S, k], -1 where the capacity dropped it, the route's gate [S, k], tokens per expert [E] before drops).
    With ``moe_router_enable_expert_bias`` it holds ``balance_bias`` (a parameter without gradient, left out of the
    optimizer, fp32 whatever the model's dtype: a parameter so that full state dicts, checkpoints at every layout,
    imports and exports carry it as they carry the weights; transformers' ``e_score_correction_bias``; not named
    ``expert_bias``: DeepSpeed-MoE saves every state-dict entry whose name holds "expert" as an expert's) and counts
    in ``load_since_update`` the routes each expert got in training since ``update_expert_biases`` last read
    them."""

    def setup(self, config: GPTConfig):
        self.k = config.moe_top_k
        self.normalize = config.moe_norm_topk_prob
        self.capacity = config.moe_capacity_factor
        self.min_capacity = config.moe_min_capacity
        self.policy = RouterPolicy.from_config(config)
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.bias_rate_follows_lr = config.moe_router_bias_rate_schedule == "lr"
        if config.moe_router_enable_expert_bias:
            self.balance_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)
            self.load_since_update = torch.zeros(config.num_experts, dtype=torch.float32)
        else:
            self.balance_bias = self.load_since_update = None
        self.z_loss = None
        self.dropped_fraction = None

    def _apply(self, fn, recurse=True):
        """Moves keep ``balance_bias`` in fp32 (a cast of the model to bf16 would round its small steps away)."""
        bias = self._parameters.pop("balance_bias", None)
        super()._apply(fn, recurse)
        if bias is not None:
            probe = fn(torch.zeros((), dtype=torch.float32, device=bias.device))
            # a move (or to_empty) as every tensor's; a cast leaves it fp32
            moved = fn(bias.data) if probe.dtype == torch.float32 else bias.data.to(probe.device)
            self.balance_bias = nn.Parameter(moved, requires_grad=False)
            counts = self.load_since_update  # (none yet in a model built on the meta device)
            self.load_since_update = (torch.zeros(counts.shape, device=probe.device) if counts.is_meta
                                      else counts.to(probe.device))
        return self

    def forward(self, input, used_token=None, sparse_routes=True, use_tutel=False, sequence_length=None):
        if not sparse_routes or use_tutel or used_token is not None:
            raise ValueError("ReferenceGate gives sparse routes only (no Tutel, no used_token)")
        logits = F.linear(input.float(), self.wg.weight.float())
        factor = self.capacity if self.training else None  # evaluation is dropless
        weights, experts, _, kept, _, l_aux, z_loss, counts = route(
            logits, self.k, self.normalize, factor, self.min_capacity, self.policy, self.balance_bias, sequence_length)
        self.z_loss = z_loss
        self.dropped_fraction = (1.0 - kept.float().mean()).detach()
        if self.load_since_update is not None and self.training:
            self.load_since_update += counts.detach().float()
        gates = weights * kept
        if self.normalize and factor is not None:  # renormalised over the routes kept, as DeepSpeed's
            gates = gates / gates.sum(-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        if self.policy.scaling != 1.0:
            gates = gates * self.policy.scaling
        return l_aux, torch.where(kept, experts, torch.full_like(experts, -1)), gates, counts.detach()


def _moe_layer_class():
    """DeepSpeed's ``MOELayer`` with the dispatch of ``dispatch`` (built where an MoE is, as the gate is)."""
    from deepspeed.moe.sharded_moe import MOELayer  # noqa: PLC0415
    return type("RoutedMOELayer", (MOELayer,), {"forward": dispatch})


class _AllToAllRows(torch.autograd.Function):
    """Rows to and from every rank of ``group``: ``send[i]`` rows of ``x`` (in rank order) go to rank i, ``recv[i]``
    come from it; the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        collectives.all_to_all_rows(out, x.contiguous(), recv, send, group, name="ep")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        collectives.all_to_all_rows(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group, name="ep")
        return out, None, None, None


def dispatch(self, x: torch.Tensor, used_token=None) -> torch.Tensor:
    """``MOELayer.forward`` on the routes alone: every kept route's token, grouped by expert, goes to its expert's
    EP rank (an all-to-all of rows, after one of the counts, as Megatron-Core's all-to-all dispatcher), each
    expert runs on exactly its own tokens, and the results come back weighted by their gates (summed in fp32).
    DeepSpeed's own dispatch pads every expert to one capacity: dropless, the busiest expert's load on any EP
    rank, so the experts computed 1.3x the routes and more at EP 2 (docs/moe.md). Under TP the ranks hold the
    same tokens and route them alike; each exchanges them with its own EP group, and its experts' 1/TP columns
    read all of them (the row-parallel all-reduce is the expert's own)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    self.l_aux, experts, gates, self.exp_counts = self.gate(flat, used_token, True, False,
                                                            sequence_length=x.shape[-2] if x.dim() > 2 else None)
    k, local = experts.shape[1], self.num_local_experts
    routes = experts.reshape(-1)                                   # route t * k + c: token t's c-th choice
    kept = (routes >= 0).nonzero().squeeze(1)
    order = kept[torch.argsort(routes[kept], stable=True)]         # kept routes grouped by expert
    rows = flat.index_select(0, order // k)
    counts = torch.bincount(routes[order], minlength=self.ep_size * local)
    if self.ep_size > 1:
        sent = counts.view(self.ep_size, local)
        received = torch.empty_like(sent)
        collectives.all_to_all_rows(received, sent, [1] * self.ep_size, [1] * self.ep_size, self.ep_group,
                                    name="ep")
        send, by_source = sent.sum(1).tolist(), received.tolist()  # the one host sync: sizes of the exchange
        rows = _AllToAllRows.apply(rows, send, [sum(r) for r in by_source], self.ep_group)
        # received source-major (source rank, then its expert); the experts read them expert-major
        pieces = torch.arange(rows.shape[0]).split([n for r in by_source for n in r])
        expert_major = torch.cat([pieces[s * local + e] for e in range(local) for s in range(self.ep_size)])
        sizes = [sum(r[e] for r in by_source) for e in range(local)]
        rows = rows.index_select(0, expert_major)
    else:
        sizes = counts.tolist()
    local_experts = self.experts.deepspeed_experts
    if self.grouped_gemm and local_experts[0].tiles > 1:
        out = tiled_grouped_experts(local_experts, rows, sizes, local_experts[0].tiles)
    elif self.grouped_gemm:
        out = grouped_experts(local_experts, rows, sizes)
    else:
        out = torch.cat([expert(part) for expert, part in zip(local_experts, rows.split(sizes))])
    if self.ep_size > 1:
        out = out.index_select(0, torch.argsort(expert_major))
        out = _AllToAllRows.apply(out, [sum(r) for r in by_source], send, self.ep_group)
    weighted = out.float() * gates.reshape(-1)[order].unsqueeze(1)
    combined = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).index_add_(0, order // k, weighted)
    return combined.to(x.dtype).reshape(x.shape)


def make_gate(config: GPTConfig) -> nn.Module:
    cls = type("ReferenceTopKGate", (ReferenceGate, _topk_gate_class()), {})
    gate = cls(config.hidden_size, config.num_experts, k=config.moe_top_k, min_capacity=config.moe_min_capacity,
               drop_tokens=config.moe_capacity_factor is not None, use_rts=False, top2_2nd_expert_sampling=False)
    gate.setup(config)
    return gate


class SharedExpertMLP(FeedForward):
    """The always-on expert beside the routed ones (DeepSeek's ``shared_experts``, an MLP of n_shared x the
    experts' width; Qwen2-MoE's ``shared_expert``): a dense MLP of ``moe_shared_expert_intermediate_size``, split
    over TP as the dense MLP, replicated over the expert-parallel ranks."""

    def __init__(self, config: GPTConfig, init_std: float, out_std: float):
        super().__init__(gated=config.variant == "llama")
        h, f = config.hidden_size, config.moe_shared_expert_intermediate_size
        self.fc_in = ColumnParallelLinear(h, output_sizes=(f, f) if self.gated else (f,), bias=config.bias,
                                          init_method=normal_init(init_std))
        self.fc_out = RowParallelLinear(f, h, bias=config.bias, input_is_parallel=True,
                                        init_method=normal_init(out_std))


class MoEMLP(nn.Module):
    """The MLP of an MoE layer: ``moe`` is DeepSpeed's ``MoE`` (its experts ``ExpertMLP``s, its gate a
    ``ReferenceGate``), plus ``shared_expert`` if the config has one (times sigmoid(``shared_expert_gate``(x)) with
    ``moe_shared_expert_gate``). After each forward, ``aux_loss`` holds coeff x load-balancing loss (+ z-loss
    coeff x z-loss), with its graph, for ``GPT.forward`` to add to the loss; ``exp_counts`` the tokens per
    expert. ``moe_grouped_gemm``: the local experts run as grouped products (models/moe/grouped.py)."""

    def __init__(self, config: GPTConfig, layout: Layout, init_std: float, out_std: float):
        super().__init__()
        from deepspeed.moe.layer import MoE  # noqa: PLC0415
        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        expert = ExpertMLP(config, ffn, layout.tiled_mlp)
        # under sequence parallelism the layer routes the whole sequence, replicated over TP as without it
        self.sequence_parallel = layout.sequence_parallel
        self.moe = MoE(config.hidden_size, expert, num_experts=config.num_experts,
                       ep_size=layout.expert, k=config.moe_top_k,
                       capacity_factor=config.moe_capacity_factor or 1.0,
                       min_capacity=config.moe_min_capacity, drop_tokens=config.moe_capacity_factor is not None,
                       use_rts=False, top2_2nd_expert_sampling=False,
                       enable_expert_tensor_parallelism=tp_world_size() > 1)
        ds_layer = self.moe.deepspeed_moe
        self.moe.deepspeed_moe = _moe_layer_class()(make_gate(config), ds_layer.experts, ds_layer.ep_group_name,
                                                    ds_layer.ep_size, ds_layer.num_local_experts)
        self.coeff, self.z_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.aux_loss = None
        self.exp_counts = None
        self.stat_sums = None  # [tokens per expert..., dropped routes, routes, aux loss, forwards] (training)
        self.moe.deepspeed_moe.grouped_gemm = config.moe_grouped_gemm
        self.balancing = config.moe_router_load_balancing_type != "none"
        self._init_experts(config, layout, expert, init_std, out_std)
        nn.init.normal_(self.moe.deepspeed_moe.gate.wg.weight, std=init_std)
        shared = config.moe_shared_expert_intermediate_size is not None
        self.shared_expert = SharedExpertMLP(config, init_std, out_std) if shared else None
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False)
                                   if config.moe_shared_expert_gate else None)
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=init_std)

    def _init_experts(self, config: GPTConfig, layout: Layout, template: ExpertMLP, init_std: float,
                      out_std: float) -> None:
        """DeepSpeed deep-copies one expert (the copies lose the ShardSpecs, given back here): every expert gets
        its own draw. Every rank draws all ``num_experts`` full (TP=1) weights in global order and keeps its own
        (``ep_rank x local + i``), its TP shard of them, so that the weights and the RNG stream after them are
        the same at every expert- and tensor-parallel size."""
        local = self.moe.deepspeed_moe.experts.deepspeed_experts
        specs = {name: get_shard_spec(p) for name, p in template.named_parameters()}
        for expert in local:
            for name, p in expert.named_parameters():
                if specs[name] is not None:
                    set_shard_spec(p, specs[name])
        # DeepSpeed's expert groups: consecutive ranks of the data-parallel group, its rank there = dp rank mod EP
        first = get_parallel_state().get_sequence_data_parallel_rank() % layout.expert * len(local)
        self.first_expert = first  # the global index of local expert 0 (expert_slice)
        for e in range(config.num_experts):
            ours = local[e - first] if first <= e < first + len(local) else None
            for lin, std in (("fc_in", init_std), ("fc_out", out_std)):
                weight = getattr(ours or local[0], lin).weight
                spec = get_shard_spec(weight)
                drawn = nn.init.normal_(weight.new_empty(_full_shape(weight)), std=std)
                if ours is not None:
                    with torch.no_grad():
                        weight.copy_(spec.shard(drawn, tp_rank(), tp_world_size()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # the gradient of the whole sequence is whole on every rank: keep the chunk
            x = gather_from_sequence_parallel_region(x, 1, tensor_parallel_output_grad=False)
        out = self._route(x)
        return scatter_to_sequence_parallel_region(out, 1) if self.sequence_parallel else out

    # in a compiled block (models/compile.py) the routed experts run eagerly, between the block's two graphs: the
    # rows each expert gets are counted on the host (the exchange's sizes), DeepSpeed's all-to-all moves them, and the
    # statistics and losses the layer keeps for the step are set as in an eager block. One function for every layer,
    # so the blocks share their graphs rather than recompiling for each (Dynamo's recompile limit is 8).
    @torch.compiler.disable
    def _route(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, self.exp_counts = self.moe(x)
        gate = self.moe.deepspeed_moe.gate
        self.aux_loss = ((self.coeff * l_aux if self.balancing else torch.zeros_like(l_aux))
                         + (self.z_coeff * gate.z_loss if self.z_coeff else 0.0))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.training:  # summed over the training forwards until moe_step_stats reads them
            routes, dropped = self.exp_counts.sum(), gate.dropped_fraction * self.exp_counts.sum()
            sums = torch.cat([self.exp_counts.float(), torch.stack([dropped, routes, self.aux_loss.detach(),
                                                                    torch.ones_like(routes)]).float()])
            self.stat_sums = sums if self.stat_sums is None else self.stat_sums + sums
        return out


# the expert index in a DeepSpeed-MoE parameter name
EXPERT_INDEX = re.compile(r"(?<=\.deepspeed_experts\.)(\d+)(?=\.)")


def is_balance_bias(name: str) -> bool:
    """Whether parameter ``name`` is a gate's balancing bias (no gradient: in no optimizer's state)."""
    return name.endswith(".gate.balance_bias")


@dataclass(frozen=True)
class ExpertSlice:
    """This rank's experts among an MoE layer's: local expert i is global expert ``first + i`` (of ``count``
    here). A full state dict names every expert by its global index; the model's parameters by the local one."""
    first: int = 0
    count: int = 0

    def full_name(self, name: str) -> str:
        """The full state dict's name of this rank's parameter ``name``."""
        return EXPERT_INDEX.sub(lambda m: str(self.first + int(m.group(1))), name) if self.first else name

    def holds(self, full_name: str) -> bool:
        """Whether this rank has the tensor ``full_name`` of a full state dict (another rank's expert: no)."""
        m = EXPERT_INDEX.search(full_name)
        return m is None or not self.count or self.first <= int(m.group(1)) < self.first + self.count


def expert_slice(model: nn.Module) -> ExpertSlice:
    """The experts of this rank (every MoE layer splits its experts alike); ExpertSlice() for a dense model."""
    for m in model.modules():
        if isinstance(m, MoEMLP):
            return ExpertSlice(m.first_expert, len(m.moe.deepspeed_moe.experts.deepspeed_experts))
    return ExpertSlice()


def gather_experts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict of every expert from ``state``, this rank's (its TP=1 tensors, experts named by their
    local index): the experts of the other ranks of its expert-parallel group are gathered (collective over that
    group), all named by their global index, in the order of a model at EP 1. ``state`` itself at EP 1."""
    experts = expert_slice(model)
    layer = next((m.moe.deepspeed_moe for m in model.modules() if isinstance(m, MoEMLP)), None)
    if layer is None or layer.ep_size == 1:
        return state
    mine = {experts.full_name(name): value for name, value in state.items() if EXPERT_INDEX.search(name)}
    every = [None] * layer.ep_size
    torch.distributed.all_gather_object(every, mine, group=layer.ep_group)
    gathered = {name: value for part in every for name, value in part.items()}
    total = layer.ep_size * experts.count
    out, layers = {}, set()
    for name, value in state.items():
        m = EXPERT_INDEX.search(name)
        if m is None:
            out[name] = value
            continue
        prefix = name[:m.start()]  # the layer's experts: emitted all at once, in global order, where first met
        if prefix not in layers:
            layers.add(prefix)
            tensors = [key[len(prefix) + 2:] for key in state if key.startswith(prefix + "0.")]
            out.update((f"{prefix}{e}.{t}", gathered[f"{prefix}{e}.{t}"]) for e in range(total) for t in tensors)
    return out


def register_expert_groups(state) -> None:
    """Hand DeepSpeed-MoE the layout's expert and expert-data groups (``ParallelState.expert_groups``) under the
    name it looks them up by (``ep_size_E``), so that it builds none of its own."""
    from deepspeed.utils import groups  # noqa: PLC0415
    forget_expert_groups()
    name = f"ep_size_{state.layout.expert}"
    ep, ep_ranks, expert_data, expert_data_ranks = state.expert_groups()
    groups._EXPERT_PARALLEL_GROUP[name], groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep, ep_ranks
    groups._EXPERT_DATA_PARALLEL_GROUP[name], groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = (expert_data,
                                                                                               expert_data_ranks)
    groups.expert_tensor_parallel_world_size = state.tensor_parallel


def forget_expert_groups() -> None:
    """Forget DeepSpeed's expert and expert-data groups of an engine built before in this process: DeepSpeed
    keeps them by name (``ep_size_E``) for the process's life, so a second engine at another layout (a test, a
    notebook) would reuse groups of the first's ranks. The new engine creates its own."""
    from deepspeed.utils import groups  # noqa: PLC0415
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        cache.clear()
    groups.expert_tensor_parallel_world_size = 1


def moe_step_stats(model: nn.Module, group=None, pipe_group=None) -> dict:
    """The MoE layers' routing since the last call, summed over ``group`` (the data-parallel ranks): per layer
    the tokens per expert (DeepSpeed's exp_counts: top-k routes, before any drop), the max/mean load ratio and
    the fraction of routes dropped by the capacity; the mean auxiliary loss (coeff x loss, summed over layers).
    ``pipe_group``: the pipeline stages, whose layers are gathered in stage order (every stage gets them all).
    Empty for a dense model."""
    layers = []
    for mlp in (m for m in model.modules() if isinstance(m, MoEMLP)):
        if mlp.stat_sums is None:
            continue
        sums, mlp.stat_sums = mlp.stat_sums, None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(sums, group=group)
        layers.append(sums.cpu())
    if pipe_group is not None and torch.distributed.get_world_size(pipe_group) > 1:
        stages = [None] * torch.distributed.get_world_size(pipe_group)
        torch.distributed.all_gather_object(stages, layers, group=pipe_group)
        layers = [sums for stage in stages for sums in stage]
    record, aux = {}, 0.0
    for i, sums in enumerate(layers):
        counts, (dropped, routes, aux_sum, forwards) = sums[:-4], sums[-4:].tolist()
        record[f"moe_tokens_per_expert_{i}"] = [int(c) for c in counts.tolist()]
        record[f"moe_load_ratio_{i}"] = float(counts.max() / counts.mean().clamp(min=1e-9))
        record[f"moe_dropped_fraction_{i}"] = dropped / max(routes, 1.0)
        aux += aux_sum / forwards
    if record:
        record["moe_aux_loss"] = aux
    return record


def expert_bias_gates(model: nn.Module) -> list[nn.Module]:
    """The gates of ``model``'s MoE layers that hold a balancing bias, in layer order."""
    gates = (m.moe.deepspeed_moe.gate for m in model.modules() if isinstance(m, MoEMLP))
    return [g for g in gates if g.balance_bias is not None]


@torch.no_grad()
def update_expert_biases(model: nn.Module, group=None, lr_decay: float = 1.0) -> list[torch.Tensor]:
    """Auxiliary-loss-free balancing, after an optimizer step: every gate's ``balance_bias`` moves by
    ``rate * sign(mean load - load)`` (the rate times ``lr_decay``, the LR's decay factor at the step, where
    ``moe_router_bias_rate_schedule`` is "lr"), the load being the routes each expert got in the training forwards
    since the last call, summed over ``group`` (one all-reduce for all layers). ``group`` must hold every rank that
    routed other tokens (the data-parallel ranks, the context-parallel ones too); ranks holding the same tokens (TP)
    may be in it or not: a sum over copies scales every count alike, and the sign is the same. Every rank then holds
    the same biases. Returns the loads used, per layer (empty without biases)."""
    gates = expert_bias_gates(model)
    if not gates:
        return []
    loads = torch.stack([g.load_since_update for g in gates])
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(loads, group=group)
    for gate, load in zip(gates, loads):
        rate = gate.bias_update_rate * (lr_decay if gate.bias_rate_follows_lr else 1.0)
        gate.balance_bias.copy_(updated_expert_bias(gate.balance_bias, load, rate))
        gate.load_since_update.zero_()
    return list(loads)
