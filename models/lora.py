"""Low-rank adapters (LoRA, Hu et al. 2021) on the tensor-parallel linears, cut as the layers are.

``y = base(x) + scaling * B(A(dropout(x)))`` with ``scaling = alpha / rank`` (PEFT's ``LoraConfig``), A
[rank, in] drawn as PEFT draws it (Kaiming-uniform, a = sqrt(5)), B [out, rank] zero: the adapted model starts
as the base.

* ``ColumnParallelLinear`` (output split): A replicated, B split by output rows as the base weight is. A fused
  linear ([q; k; v], [gate; up]) carries one adapter per *group* of its output parts (PEFT's separate
  ``q_proj`` and ``v_proj``, or gpt2's one ``c_attn``); a part in no group gets no update. Each rank's
  ``x A^T`` is the same; its gradient is the sum of the ranks' partial products (an f op).
* ``RowParallelLinear`` (input split): A split by input columns, B replicated; ``x A^T`` is all-reduced before B.

Both cuts are those of the base weight (``ShardSpec``), so a checkpoint's adapters gather and re-shard as every
other parameter, and TP 1 and TP 2 train the same adapter. Under sequence parallelism the column adapter gathers
the sequence as its base does, and the row adapter reduce-scatters ``x A^T`` (B, applied to this rank's chunk, is
marked sequence-parallel: its gradient is summed over TP). ``add_lora`` freezes everything else: an optimizer built from
the trainable parameters holds the adapters only. With a ``seed`` each linear's adapters are drawn from a stream of
their own (the seed and the linear's name), so they do not depend on which of the linears a process holds (a pipeline
stage's).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import (ColumnParallelLinear, RowParallelLinear, ShardSpec, copy_to_tensor_parallel_region,
                       dropout_from, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
                       mark_sequence_parallel, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
                       sequence_parallel_parameter, sharded_parameter, tensor_parallel_stream, tp_world_size)

LORA_MODULE = "lora"  # the adapter's attribute on the linear it adapts: parameters "<linear>.lora.A.<g>", ".B.<g>"


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _kaiming_a(t: torch.Tensor) -> torch.Tensor:
    # nn.Linear's (and PEFT's lora_A's) default: fan-in of the full [rank, in] matrix
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5))


class ColumnLoRA(nn.Module):
    def __init__(self, base: ColumnParallelLinear, groups: Sequence[Sequence[int]], config: LoRAConfig):
        super().__init__()
        parts = base.output_sizes
        self.config, self.groups = config, [tuple(g) for g in groups]
        self.gather_output = base.gather_output
        self.sequence_parallel, self.sequence_dim = base.sequence_parallel and tp_world_size() > 1, base.sequence_dim
        self.local_sizes = base.local_output_sizes
        device, dtype = base.weight.device, base.weight.dtype
        self.A = nn.ParameterList(nn.Parameter(_draw((config.rank, base.in_features), _kaiming_a, dtype, device))
                                  for _ in self.groups)
        self.B = nn.ParameterList(sharded_parameter((sum(parts[i] for i in g), config.rank),
                                                    ShardSpec(dim=0, parts=tuple(parts[i] for i in g)),
                                                    nn.init.zeros_, dtype, device) for g in self.groups)
        self.dropout = nn.Dropout(config.dropout)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # the whole sequence; its gradient, whole on every rank, keeps this rank's chunk
            x = gather_from_sequence_parallel_region(x, self.sequence_dim, tensor_parallel_output_grad=False)
        x = self.dropout(x)  # x is the same on every TP rank, and so is the default RNG stream
        pieces: list[torch.Tensor | None] = [None] * len(self.local_sizes)
        for g, A, B in zip(self.groups, self.A, self.B):
            z = copy_to_tensor_parallel_region(F.linear(x, A))
            update = F.linear(z, B) * self.config.scaling
            for i, piece in zip(g, update.split([self.local_sizes[i] for i in g], dim=-1)):
                pieces[i] = piece
        like = next(p for p in pieces if p is not None)
        delta = torch.cat([p if p is not None else like.new_zeros(*like.shape[:-1], self.local_sizes[i])
                           for i, p in enumerate(pieces)], dim=-1)
        return gather_from_tensor_parallel_region(delta) if self.gather_output else delta


class RowLoRA(nn.Module):
    def __init__(self, base: RowParallelLinear, config: LoRAConfig):
        super().__init__()
        self.config = config
        self.input_is_parallel = base.input_is_parallel
        self.sequence_parallel, self.sequence_dim = base.sequence_parallel, base.sequence_dim
        device, dtype = base.weight.device, base.weight.dtype
        self.A = nn.ParameterList([sharded_parameter((config.rank, base.in_features),
                                                     ShardSpec(dim=1, parts=(base.in_features,)), _kaiming_a,
                                                     dtype, device)])
        self.B = nn.ParameterList([nn.Parameter(_draw((base.out_features, config.rank), nn.init.zeros_, dtype,
                                                      device))])
        if self.sequence_parallel:
            mark_sequence_parallel(self.B[0])
        self.dropout = nn.Dropout(config.dropout)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x)
        if self.config.dropout and self.training:  # each rank drops from its own columns of x
            x = dropout_from(tensor_parallel_stream(), x, self.config.dropout)
        if self.sequence_parallel:  # this rank's chunk of the sum; B's gradient, from that chunk, summed over TP
            z = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.A[0]), self.sequence_dim)
            return F.linear(z, sequence_parallel_parameter(self.B[0])) * self.config.scaling
        z = reduce_from_tensor_parallel_region(F.linear(x, self.A[0]))
        return F.linear(z, self.B[0]) * self.config.scaling


def _draw(shape, init, dtype, device) -> torch.Tensor:
    """A replicated tensor drawn as ``sharded_parameter`` draws a master (fp32, on the CPU, the default stream)."""
    master = torch.empty(shape, dtype=torch.float32)
    init(master)
    return master.to(device=device, dtype=dtype)


def _add_update(module: nn.Module, args, output):
    adapter = getattr(module, LORA_MODULE)
    return output + adapter(args[0]) if adapter.enabled else output


def add_lora(model: nn.Module, targets: Mapping[str, Sequence[Sequence[int]] | None], config: LoRAConfig, *,
             seed: int | None = None, module_name: Callable[[str], str | None] = lambda name: name) -> list[str]:
    """Freeze ``model`` and adapt the linears named in ``targets`` (module path -> groups of output parts for a
    column-parallel linear, None for all its parts in one group, or for a row-parallel one). ``seed``: each
    linear's adapters drawn from a stream of their own (``seed`` and the target's name), the same whichever part of
    the model this process holds; without it, from the default stream in order. ``module_name``: the target's
    name in ``model`` (a pipeline stage's own), None where another process holds it. Returns the names of the
    adapters' parameters, the only trainable ones."""
    modules = dict(model.named_modules())
    local = {name: module_name(name) for name in targets}
    unknown = [name for name, here in local.items() if here is not None
               and not isinstance(modules.get(here), (ColumnParallelLinear, RowParallelLinear))]
    if unknown:
        raise ValueError(f"no column- or row-parallel linear named {', '.join(unknown)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, groups in targets.items():
        if local[name] is None:
            continue
        base = modules[local[name]]
        with _stream_of(name, seed):
            if isinstance(base, ColumnParallelLinear):
                adapter = ColumnLoRA(base, groups or [tuple(range(len(base.output_sizes)))], config)
            else:
                adapter = RowLoRA(base, config)
        base.add_module(LORA_MODULE, adapter)
        base.register_forward_hook(_add_update)
    return [n for n, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def _stream_of(target: str, seed: int | None):
    """The default stream seeded for one target's adapters, restored after; as it is without a seed."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(target.encode())) % 2**63)
        yield


def is_lora_parameter(name: str) -> bool:
    return f".{LORA_MODULE}." in f".{name}"


def lora_adapters(model: nn.Module) -> dict[str, ColumnLoRA | RowLoRA]:
    """Module path of each adapted linear -> its adapter."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (ColumnLoRA, RowLoRA))}


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """The base model: every adapter off inside the block (DPO's reference with LoRA)."""
    adapters = list(lora_adapters(model).values())
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True
