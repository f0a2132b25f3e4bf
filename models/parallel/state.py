"""Tensor-, context-, pipeline- and data-parallel process groups.

The layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data,
model; model innermost, so the ranks of one tensor-parallel group are
neighbours, usually on one node). ``ParallelState`` is the ``mpu`` object that
``deepspeed.initialize(mpu=...)`` and ``deepspeed.checkpointing.configure``
expect: "model parallel" there means tensor parallel.

Without ``torch.distributed`` initialised everything is size 1 and the groups
are ``None``, so the models run unchanged in a plain single process.

Context parallelism (DeepSpeed-Ulysses, ``context_parallel`` C > 1) adds an axis between data and model
(pipe, data, context, model): the C ranks of a context group hold C chunks of the same sequences. The mpu then
answers DeepSpeed's sequence-parallel questions (``get_sequence_parallel_*``: the context group) and its
sequence-data-parallel ones (``get_sequence_data_parallel_*``: data x context, over which the engine and ZeRO
reduce and shard gradients). "Sequence parallel" in those names is DeepSpeed's word for context parallelism,
not Megatron's sequence parallelism inside the TP group.
"""
from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from .layout import Layout


class ParallelConfigError(ValueError):
    user_error = True  # a command reports it in one line (pipeline.job.errors.is_user_error)


class ParallelState:
    """The process groups of a ``Layout`` (given whole, or as its three model-parallel sizes: the rest of the layout
    at its defaults). ``layout`` is the run's layout with its data-parallel size filled in from the world."""

    def __init__(self, tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1, *,
                 layout: Layout | None = None):
        if layout is not None:
            tensor_parallel, pipeline_parallel, context_parallel = layout.tensor, layout.pipeline, layout.context
        if tensor_parallel < 1 or pipeline_parallel < 1 or context_parallel < 1:
            raise ParallelConfigError(f"tensor_parallel ({tensor_parallel}), pipeline_parallel ({pipeline_parallel}) "
                                      f"and context_parallel ({context_parallel}) must be >= 1")
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        model_ranks = tensor_parallel * context_parallel * pipeline_parallel
        if world % model_ranks:
            cp_axis, cp_size = ((" x context_parallel", f"context_parallel ({context_parallel}) x ")
                                if context_parallel > 1 else ("", ""))
            raise ParallelConfigError(
                f"world size {world} is not tensor_parallel{cp_axis} x pipeline_parallel x data_parallel: "
                f"{world} is not divisible by tensor_parallel ({tensor_parallel}) x {cp_size}pipeline_parallel "
                f"({pipeline_parallel}) = {model_ranks}; launch a multiple of {model_ranks} processes or change "
                f"the parallel sizes")
        self.layout = (layout or Layout(tensor=tensor_parallel, pipeline=pipeline_parallel,
                                        context=context_parallel)).replace(data=world // model_ranks)
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.context_parallel = context_parallel
        self.data_parallel = world // model_ranks
        self.world_size = world
        self.rank = dist.get_rank() if self.distributed else 0

        axes = ("model", "data", "pipe")
        if context_parallel == 1:
            self.topology = PipeModelDataParallelTopology(
                num_pp=pipeline_parallel, num_mp=tensor_parallel, num_dp=self.data_parallel)
        else:
            self.topology = ProcessTopology(axes=["pipe", "data", "context", "model"],
                                            dims=[pipeline_parallel, self.data_parallel, context_parallel,
                                                  tensor_parallel])
            axes += ("context",)
        coord = self.topology.get_coord(self.rank)._asdict()
        self._rank = {axis: coord.get(axis, 0) for axis in ("model", "data", "pipe", "context")}
        self._group = {}
        self._group_ranks = {}
        for axis in axes:
            self._make_groups(axis, self.topology.get_axis_comm_lists(axis))
        if context_parallel == 1:
            self._group["context"], self._group_ranks["context"] = None, [self.rank]
            self._group["data_context"] = self._group["data"]
            self._group_ranks["data_context"] = self._group_ranks["data"]
        else:  # data x context: the ranks that share this rank's pipe and model coordinates
            self._make_groups("data_context", self._all_data_context_groups())
        self._rank["data_context"] = self._group_ranks["data_context"].index(self.rank)

    def _make_groups(self, axis: str, rank_lists) -> None:
        for ranks in rank_lists:
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

    # -- context parallel: DeepSpeed's "sequence parallel" (Ulysses) names --------------
    def get_context_parallel_rank(self):
        return self._rank["context"]

    def get_context_parallel_world_size(self):
        return self.context_parallel

    def get_context_parallel_group(self):
        return self._group["context"]

    get_sequence_parallel_rank = get_context_parallel_rank
    get_sequence_parallel_world_size = get_context_parallel_world_size
    get_sequence_parallel_group = get_context_parallel_group

    def get_sequence_data_parallel_rank(self):
        return self._rank["data_context"]

    def get_sequence_data_parallel_world_size(self):
        return self.data_parallel * self.context_parallel

    def get_sequence_data_parallel_group(self):
        return self._group["data_context"]

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

    def get_expert_parallel_world_size(self):
        return self.layout.expert

    def expert_groups(self):
        """(expert-parallel group, its ranks, expert-data-parallel group, its ranks) of the layout's EP size, built
        on first use (collective). Both are cut from data x context: the sequence chunks of context parallelism
        route their tokens to the experts as the replicas do, and the experts' gradients are summed over the chunks
        as every other parameter's. Consecutive E ranks of data x context share their experts (DeepSpeed's order:
        the expert rank is the data x context rank mod E)."""
        if "expert" not in self._group:
            ep = self.layout.expert
            for ranks in self._all_data_context_groups():
                self._make_groups("expert", [ranks[i:i + ep] for i in range(0, len(ranks), ep)])
                self._make_groups("expert_data", [ranks[i::ep] for i in range(ep)])
        return (self._group["expert"], self._group_ranks["expert"], self._group["expert_data"],
                self._group_ranks["expert_data"])

    def _all_data_context_groups(self):
        return [self.topology.filter_match(pipe=p, model=m) for p in range(self.pipeline_parallel)
                for m in range(self.tensor_parallel)]

    def __repr__(self):
        return (f"ParallelState(rank={self.rank}, tp={self.tensor_parallel}, cp={self.context_parallel}, "
                f"pp={self.pipeline_parallel}, dp={self.data_parallel}, coords={self._rank})")


_STATE: ParallelState | None = None


def initialize_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1,
                              context_parallel: int = 1, *, layout: Layout | None = None) -> ParallelState:
    """Build the process groups of ``layout`` (or of the three sizes) and make them current (collective: call on
    every rank)."""
    global _STATE
    _STATE = ParallelState(tensor_parallel, pipeline_parallel, context_parallel, layout=layout)
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


def cp_world_size() -> int:
    return get_parallel_state().get_context_parallel_world_size()


def cp_rank() -> int:
    return get_parallel_state().get_context_parallel_rank()


def cp_group():
    return get_parallel_state().get_context_parallel_group()
