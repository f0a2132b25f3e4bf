"""All local experts' work as one grouped matrix product per linear (``moe_grouped_gemm``), in place of a Python
loop over the experts' modules.

The rows come grouped by expert (``sizes[e]`` rows for local expert e, in order). Each linear stacks the experts'
weights [E, out, in] and runs ``torch._grouped_mm`` over the groups where it runs and is the faster path
(``GROUPED_MM_DTYPES``: fp32 and fp16 on a CPU, bf16 on a GPU; both widths a multiple of 16 bytes); elsewhere the rows
are padded once into an [E, max rows, in] batch for two ``torch.bmm``. The experts keep their modules and
parameters (DeepSpeed's ``Experts`` container, their TP split and names): the TP collectives run once for all
experts instead of once per expert, the column-parallel f op on the input and the row-parallel all-reduce on the
output.

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

# where torch._grouped_mm runs and is the faster path; bf16 on a CPU takes the batched products over padded rows:
# torch's CPU _grouped_mm multiplies group by group, where one batched bf16 product (oneDNN) ran the DeepSeek-style
# layer's step 1.33x the loop's tokens/s against 1.24x (2.04x against 1.32x at 32 tokens; bench/moe.py --dispatch)
GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.float16), "cuda": (torch.bfloat16,)}


def grouped_mm_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` [T, in] against ``weights`` [E, out, in] on this device
    (both widths: the backward multiplies by the weights the other way)."""
    return (hasattr(torch, "_grouped_mm") and x.dtype in GROUPED_MM_DTYPES.get(x.device.type, ())
            and all(n * x.element_size() % 16 == 0 for n in weights.shape[1:]))


class _Padding:
    """Rows grouped by expert (``sizes`` [E]) laid out as an [E, max rows, width] batch and taken back."""

    def __init__(self, sizes: torch.Tensor):
        self.experts = sizes.shape[0]
        self.expert = torch.repeat_interleave(torch.arange(self.experts, device=sizes.device), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        self.slot = torch.arange(self.expert.shape[0], device=sizes.device) - starts[self.expert]
        self.rows = int(sizes.max()) if self.expert.shape[0] else 0

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.experts, self.rows, x.shape[1]).index_put((self.expert, self.slot), x)

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        return batch[self.expert, self.slot]


class _BatchedLinear(torch.autograd.Function):
    """``x`` [E, rows, in] times each expert's ``weight`` [E, out, in] transposed, its weight gradient computed as
    [E, out, in] (``bmm``'s own backward gives the transposed layout, which every expert's gradient would then
    copy out of)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.bmm(x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def padded_grouped_linear(x: torch.Tensor, weights: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The sorted batched product: the rows padded to [E, max rows, in], one bmm, the rows taken back."""
    padding = _Padding(sizes)
    return padding.take(_BatchedLinear.apply(padding.pad(x), weights))


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
    experts being ``models.moe.ExpertMLP``s (one ``FeedForward`` each, alike), as two grouped products (or, where
    ``torch._grouped_mm`` does not fit or is the slower path, two batched ones over the rows padded once).
    ``recompute_act`` (``moe_act``) is honoured as the experts' own forward does."""
    counts = torch.tensor(list(sizes), device=rows.device)
    x = copy_to_tensor_parallel_region(rows)
    w_in = torch.stack([e.fc_in.weight for e in experts])
    w_out = torch.stack([e.fc_out.weight for e in experts])
    if grouped_mm_fits(x, w_in) and grouped_mm_fits(x, w_out):
        h = grouped_linear(x, w_in, counts)
        bias_in = _per_row([e.fc_in.bias for e in experts], counts)
        y = _activated_product(experts[0], h if bias_in is None else h + bias_in,
                               lambda a: grouped_linear(a, w_out, counts))
    else:  # [E, max rows, width] from the first product to the second: one pad, one take
        padding = _Padding(counts)
        h = _BatchedLinear.apply(padding.pad(x), w_in)
        if experts[0].fc_in.bias is not None:
            h = h + torch.stack([e.fc_in.bias for e in experts])[:, None]
        y = padding.take(_activated_product(experts[0], h, lambda a: _BatchedLinear.apply(a, w_out)))
    y = reduce_from_tensor_parallel_region(y)
    bias_out = _per_row([e.fc_out.bias for e in experts], counts)
    return y if bias_out is None else y + bias_out


def _activated_product(first: torch.nn.Module, h: torch.Tensor, product) -> torch.Tensor:
    """``product`` of the experts' activation of ``h``; under ``recompute_act`` the activation is discarded once
    the product holds what it needs, and recomputed in the backward."""
    if first.recompute_act and first.training and torch.is_grad_enabled():
        act = DiscardedOutput(first._activation, h)
        y = product(act.output)
        act.discard(y)
        return y
    return product(first._activation(h))


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
