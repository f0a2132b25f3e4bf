"""FP8 compute for the column- and row-parallel linears: torchao's float8 training recipes (``tensorwise``,
``rowwise``), the TP collectives left outside the FP8 matmul.

FP8 is a compute format only: the weights stay the run's fp32 / bf16 parameters (state dicts, checkpoints and
exports do not change); each of a linear's three matmuls (output, input gradient, weight gradient) casts its two
operands to float8 with a dynamic scale from their amax, as torchao's ``matmul_with_hp_or_float8_args`` does
with the same torchao casts and config. What differs is the scales of the TP-split operands: an amax that spans
the split axis (every amax of a tensorwise cast, the per-token amax over a split feature axis in rowwise) is
MAX-reduced over the TP group, so each shard is scaled as the whole tensor is and the TP result equals torchao's
on the unsplit ``nn.Linear`` up to the fp32 summation order (tests/models/test_fp8.py measures it). Under context
parallelism each rank holds a chunk of the sequence, so an amax that spans the tokens is MAX-reduced over the CP
group too, and CP 2 computes what one process does (the composition matrix, tests/composition.py). The cost is
one small all-reduce per such cast (a scalar in tensorwise, a [tokens] or [features] vector in rowwise), as
Transformer Engine reduces its amaxes over its TP x CP group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.config import CastConfig, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from .layers import ColumnParallelLinear, RowParallelLinear
from .layout import FP8_RECIPES
from .mappings import all_reduce_max
from .state import cp_world_size, tp_world_size

RECIPES = FP8_RECIPES
# the axes of the 2-D operands of the three matmuls: x [tokens, in], weight^T [in, out], grad_output [tokens, out]
_INPUT, _WEIGHT_T, _GRAD_OUTPUT = ("tokens", "in"), ("in", "out"), ("tokens", "out")


@dataclass(frozen=True)
class Float8Matmul:
    """x @ weight^T in FP8 for one parallel linear: torchao's recipe ``config``, its matmul settings
    ``mm_config``, and the linear's axis split over TP (``"out"`` column-parallel, ``"in"`` row-parallel)."""
    config: Float8LinearConfig
    mm_config: LinearMMConfig
    split_axis: str

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _Float8ParallelMatmul.apply(x, weight, self)

    def cast(self, hp: torch.Tensor, cast: CastConfig, role: GemmInputRole, axiswise_dim: int, axes: tuple):
        """``hp`` (2-D, its axes named by ``axes``) in float8 as torchao casts it, its amax MAX-reduced over TP
        where the amax spans the split axis, and over CP where it spans the tokens."""
        if cast.scaling_type is ScalingType.DISABLED:
            return hp
        dim = get_maybe_axiswise_dim(axiswise_dim, cast.scaling_granularity)
        amax = tensor_to_amax(hp, scaling_granularity=cast.scaling_granularity, axiswise_dim=dim)
        spanned = axes if dim is None else (axes[dim],)
        if self.split_axis in spanned and tp_world_size() > 1:
            amax = all_reduce_max(amax, "tp")
        if "tokens" in spanned and cp_world_size() > 1:
            amax = all_reduce_max(amax, "cp")
        scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(hp, scale, cast.target_dtype, self.mm_config, role, dim)


class _Float8ParallelMatmul(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` for this rank's shard (operands in high precision, the
    weight [out, in] as a parameter holds it), with ``Float8Matmul.cast``'s TP-reduced scales."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Float8Matmul):
        ctx.save_for_backward(x, weight)
        ctx.fp8 = fp8
        c = fp8.config
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.mm(fp8.cast(x2, c.cast_config_input, GemmInputRole.INPUT, -1, _INPUT),
                       fp8.cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, _WEIGHT_T))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        fp8 = ctx.fp8
        c = fp8.config
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(
                fp8.cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, _GRAD_OUTPUT),
                fp8.cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, _WEIGHT_T).t(),
            ).reshape(*grad.shape[:-1], x.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(
                fp8.cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0,
                         _GRAD_OUTPUT).t(),
                fp8.cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0,
                         _INPUT))
        return grad_x, grad_w, None


def float8_config(recipe: str, emulate: bool = False) -> Float8LinearConfig:
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def linear_mm_config(config: Float8LinearConfig) -> LinearMMConfig:
    """The three matmuls' settings exactly as torchao's ``Float8Linear`` derives them from ``config``."""
    return Float8Linear(1, 1, bias=False, config=config, device="meta").linear_mm_config


def fp8_matmuls_on(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 in hardware: a CUDA GPU of compute capability 8.9 (Ada) or later.
    (torch's CPU ``_scaled_mm`` is a reference loop, ~1000x slower than an fp32 matmul on this project's CPU.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def enable_fp8(model: nn.Module, recipe: str, emulate: bool | None = None) -> int:
    """Run every column- and row-parallel linear of ``model`` in FP8 with torchao's ``recipe`` (tensorwise or
    rowwise); the embeddings, the output layer and MoE routers are not parallel linears and stay as they are.
    The parameters are untouched. Returns the number of linears converted. ``emulate``: torchao's emulation, the
    same float8 operands and scales multiplied in fp32 (its rowwise output is not rounded through bf16 as
    ``_scaled_mm``'s is); None: where the device of the model's parameters has no FP8 matmuls
    (``fp8_matmuls_on``)."""
    if emulate is None:
        emulate = not fp8_matmuls_on(next(model.parameters()).device)
    config = float8_config(recipe, emulate)
    mm_config = linear_mm_config(config)
    converted = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            split = "out" if isinstance(module, ColumnParallelLinear) else "in"
            module.fp8 = Float8Matmul(config, mm_config, split)
            converted += 1
    return converted


def disable_fp8(model: nn.Module) -> None:
    """Back to the run's own precision (an FP8 run resumed without it)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8 = None
