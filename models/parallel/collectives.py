"""The project's own collectives (TP f/g, sequence-parallel gathers and scatters, the vocab-parallel
cross-entropy's reductions, the experts' exchange of tokens), through ``deepspeed.comm`` once DeepSpeed's
process group is up, so that DeepSpeed's comms logger (``"comms_logger"`` in the DeepSpeed config) counts them
beside ZeRO's and the pipeline engine's, under the names ``tp/all_reduce``, ``tp/all_gather``,
``tp/all_gather_into_tensor``, ``tp/reduce_scatter_tensor``, ``ep/all_to_all_single``; through
``torch.distributed`` when only a plain process group exists.

The logger records each call's message as DeepSpeed does: the tensor handed in (an all-gather's local chunk,
a reduce-scatter's full input).
"""
from __future__ import annotations

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist


def _via_deepspeed() -> bool:
    return ds_comm.is_initialized()


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, name: str = "tp") -> torch.Tensor:
    if _via_deepspeed():
        ds_comm.all_reduce(x, op=op, group=group, log_name=f"{name}/all_reduce")
    else:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_list(parts: list[torch.Tensor], x: torch.Tensor, group, name: str = "tp") -> None:
    if _via_deepspeed():
        ds_comm.all_gather(parts, x, group=group, log_name=f"{name}/all_gather")
    else:
        dist.all_gather(parts, x, group=group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, name: str = "tp") -> None:
    if _via_deepspeed():
        ds_comm.all_gather_into_tensor(out, x, group=group, log_name=f"{name}/all_gather_into_tensor")
    else:
        dist.all_gather_single(out, x, group=group)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, name: str = "tp") -> None:
    if _via_deepspeed():
        ds_comm.reduce_scatter_tensor(out, x, group=group, log_name=f"{name}/reduce_scatter_tensor")
    else:
        dist.reduce_scatter_single(out, x, group=group)


def all_to_all_rows(out: torch.Tensor, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group,
                    name: str = "ep") -> None:
    """``in_rows[i]`` rows of ``x`` (in rank order) to rank i, ``out_rows[i]`` rows from rank i into ``out``."""
    if _via_deepspeed():
        ds_comm.all_to_all_single(out, x, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group,
                                  log_name=f"{name}/all_to_all_single")
    else:
        dist.all_to_all_single(out, x, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group)
