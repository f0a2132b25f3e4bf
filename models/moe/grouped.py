"""All local experts' work as one grouped matrix product per linear (``moe_grouped_gemm``), in place of a Python
loop over the experts' modules.

The rows come grouped by expert (``sizes[e]`` rows for local expert e, in order). Each linear stacks the experts'
weights [E, out, in] and runs ``torch._grouped_mm`` over the groups; where it cannot run (its dtypes: fp32, bf16,
fp16 on a CPU, bf16 on a GPU; both widths a multiple of 16 bytes) the rows are padded into an
[E, max rows, in] batch for one ``torch.bmm``. The experts keep their modules and parameters (DeepSpeed's
``Experts`` container, their TP split and names): the TP collectives run once for all experts instead of once
per expert, the column-parallel f op on the input and the row-parallel all-reduce on the output.

Under ALST's tiled MLP (``--tiled-mlp N``) the grouped rows run in N tiles of rows through DeepSpeed's TiledMLP, as
one expert's rows do: each tile one grouped product over the experts whose rows it holds, recomputed in the backward,
so the [rows, ffn / tp] activations of all local experts are never held whole.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from ..parallel import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ..recompute import DiscardedOutput
from ..tiling import row_tiles, tiled_mlp

GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def grouped_mm_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` [T, in] against ``weights`` [E, out, in] on this device
    (both widths: the backward multiplies by the weights the other way)."""
    return (hasattr(torch, "_grouped_mm") and x.dtype in GROUPED_MM_DTYPES.get(x.device.type, ())
            and all(n * x.element_size() % 16 == 0 for n in weights.shape[1:]))


def padded_grouped_linear(x: torch.Tensor, weights: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The sorted batched product: the rows padded to [E, max rows, in], one bmm, the rows taken back."""
    E, rows = weights.shape[0], x.shape[0]
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), sizes)
    slot = torch.arange(rows, device=x.device) - (torch.cumsum(sizes, 0) - sizes)[expert]
    batch = x.new_zeros(E, int(sizes.max()) if rows else 0, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(batch, weights.transpose(1, 2))[expert, slot]


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [T, in], grouped by expert (``sizes`` [E], summing to T), times each expert's ``weights``
    [E, out, in] transposed: [T, out]."""
    if grouped_mm_fits(x, weights):
        out = torch._grouped_mm(x, weights.transpose(1, 2), offs=torch.cumsum(sizes, 0).to(torch.int32))
        if out.requires_grad:  # its backward refuses a broadcast gradient (of a sum, say)
            out.register_hook(torch.Tensor.contiguous)
        return out
    return padded_grouped_linear(x, weights, sizes)


def _per_row(biases: Sequence[torch.Tensor | None], sizes: torch.Tensor) -> torch.Tensor | None:
    if biases[0] is None:
        return None
    return torch.repeat_interleave(torch.stack(list(biases)), sizes, dim=0)


def grouped_experts(experts: Sequence[torch.nn.Module], rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """What ``torch.cat([expert(part) for expert, part in zip(experts, rows.split(sizes))])`` computes, the
    experts being ``models.moe.ExpertMLP``s (one ``FeedForward`` each, alike), as two grouped products.
    ``recompute_act`` (``moe_act``) is honoured as the experts' own forward does."""
    first = experts[0]
    counts = torch.tensor(list(sizes), device=rows.device)
    x = copy_to_tensor_parallel_region(rows)
    h = grouped_linear(x, torch.stack([e.fc_in.weight for e in experts]), counts)
    bias_in = _per_row([e.fc_in.bias for e in experts], counts)
    h = h if bias_in is None else h + bias_in
    w_out = torch.stack([e.fc_out.weight for e in experts])
    if first.recompute_act and first.training and torch.is_grad_enabled():
        act = DiscardedOutput(first._activation, h)
        y = grouped_linear(act.output, w_out, counts)
        act.discard(y)
    else:
        y = grouped_linear(first._activation(h), w_out, counts)
    y = reduce_from_tensor_parallel_region(y)
    bias_out = _per_row([e.fc_out.bias for e in experts], counts)
    return y if bias_out is None else y + bias_out


def tiled_grouped_experts(experts: torch.nn.ModuleList, rows: torch.Tensor, sizes: Sequence[int],
                          tiles: int) -> torch.Tensor:
    """``grouped_experts`` on ``tiles`` tiles of the rows (DeepSpeed's TiledMLP: each tile's products recomputed in
    the backward). A tile is a view of ``rows`` (TiledMLP cuts the same tensor in the same places, forward and
    backward), so its first row's index, and with it the experts' shares of the tile, follow from where it lies."""
    starts = list(itertools.accumulate(sizes, initial=0))
    row_bytes = rows.stride(0) * rows.element_size()

    def tile(module, part: torch.Tensor) -> torch.Tensor:
        first = (part.data_ptr() - rows.data_ptr()) // row_bytes
        last = first + part.shape[0]
        shares = [max(0, min(end, last) - max(start, first)) for start, end in zip(starts, starts[1:])]
        return grouped_experts(module, part, shares)

    rows = rows.contiguous()
    return tiled_mlp(tile, experts, rows, row_tiles(rows.shape[0], tiles))
