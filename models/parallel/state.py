"""Tensor-, pipeline- and data-parallel process groups.

The layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data,
model; model innermost, so the ranks of one tensor-parallel group are
neighbours, usually on one node). ``ParallelState`` is the ``mpu`` object that
``deepspeed.initialize(mpu=...)`` and ``deepspeed.checkpointing.configure``
expect: "model parallel" there means tensor parallel.

Without ``torch.distributed`` initialised everything is size 1 and the groups
are ``None``, so the models run unchanged in a plain single process.
"""
from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


class ParallelConfigError(ValueError):
    pass


class ParallelState:
    def __init__(self, tensor_parallel: int = 1, pipeline_parallel: int = 1):
        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise ParallelConfigError(
                f"tensor_parallel ({tensor_parallel}) and pipeline_parallel ({pipeline_parallel}) must be >= 1")
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        if world % (tensor_parallel * pipeline_parallel):
            raise ParallelConfigError(
                f"world size {world} is not tensor_parallel x pipeline_parallel x data_parallel: "
                f"{world} is not divisible by tensor_parallel ({tensor_parallel}) x pipeline_parallel "
                f"({pipeline_parallel}) = {tensor_parallel * pipeline_parallel}; launch a multiple of "
                f"{tensor_parallel * pipeline_parallel} processes or change the parallel sizes")
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.data_parallel = world // (tensor_parallel * pipeline_parallel)
        self.world_size = world
        self.rank = dist.get_rank() if self.distributed else 0

        self.topology = PipeModelDataParallelTopology(
            num_pp=pipeline_parallel, num_mp=tensor_parallel, num_dp=self.data_parallel)
        coord = self.topology.get_coord(self.rank)
        self._rank = {"model": coord.model, "data": coord.data, "pipe": coord.pipe}
        self._group = {}
        self._group_ranks = {}
        for axis in ("model", "data", "pipe"):
            for ranks in self.topology.get_axis_comm_lists(axis):
                # new_group is collective: every rank creates every group, in the same order.
                group = dist.new_group(ranks) if self.distributed else None
                if self.rank in ranks:
                    self._group[axis] = group
                    self._group_ranks[axis] = ranks

    # -- tensor (model) parallel: the names DeepSpeed and Megatron use ----------
    def get_model_parallel_rank(self):
        return self._rank["model"]

    def get_model_parallel_world_size(self):
        return self.tensor_parallel

    def get_model_parallel_group(self):
        return self._group["model"]

    def get_model_parallel_src_rank(self):
        return self._group_ranks["model"][0]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank
    # DeepSpeed's pipeline grid calls the tensor-parallel slice of a stage "slice parallel".
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group

    # -- data parallel ------------------------------------------------------------
    def get_data_parallel_rank(self):
        return self._rank["data"]

    def get_data_parallel_world_size(self):
        return self.data_parallel

    def get_data_parallel_group(self):
        return self._group["data"]

    def get_data_parallel_group_ranks(self):
        return list(self._group_ranks["data"])

    # -- pipeline parallel ----------------------------------------------------------
    def get_pipe_parallel_rank(self):
        return self._rank["pipe"]

    def get_pipe_parallel_world_size(self):
        return self.pipeline_parallel

    def get_pipe_parallel_group(self):
        return self._group["pipe"]

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def is_first_stage(self):
        return self._rank["pipe"] == 0

    def is_last_stage(self):
        return self._rank["pipe"] == self.pipeline_parallel - 1

    def __repr__(self):
        return (f"ParallelState(rank={self.rank}, tp={self.tensor_parallel}, pp={self.pipeline_parallel}, "
                f"dp={self.data_parallel}, coords={self._rank})")


_STATE: ParallelState | None = None


def initialize_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> ParallelState:
    """Build the process groups (collective: call on every rank) and make them current."""
    global _STATE
    _STATE = ParallelState(tensor_parallel, pipeline_parallel)
    return _STATE


def get_parallel_state() -> ParallelState:
    """The current state; a single-process one if nothing was initialised."""
    global _STATE
    if _STATE is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("torch.distributed is initialised with several ranks but "
                               "models.parallel.initialize_model_parallel() was not called")
        _STATE = ParallelState(1, 1)
    return _STATE


def destroy_model_parallel():
    global _STATE
    _STATE = None


def tp_world_size() -> int:
    return get_parallel_state().get_model_parallel_world_size()


def tp_rank() -> int:
    return get_parallel_state().get_model_parallel_rank()


def tp_group():
    return get_parallel_state().get_model_parallel_group()
