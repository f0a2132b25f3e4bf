"""Model-parallel RNG: the streams of Megatron-LM, and one more for context parallelism.

* The default stream is seeded with ``seed + 100 x pp_rank`` (the stage's seed):
  identical on the TP and CP ranks of a stage, so dropout on replicated activations
  (residual, embedding) draws the same mask everywhere they are replicated, and a
  model built without an ``init_seed`` draws the same weights on every rank of a stage.
* The tracked "model-parallel" stream is seeded with the stage's seed ``+ 2718 + tp_rank
  + tp x cp_rank``: it differs across the TP and CP ranks (each rank drops different heads'
  probabilities, and under sequence parallelism its own chunk's activations) and is the same
  on every data-parallel replica. Code in a TP region draws from it inside
  ``get_rng_tracker().fork()``; at CP 1 it is Megatron's ``seed + 2718 + tp_rank``.
* Under context parallelism (CP > 1) the tracked "context-parallel" stream, seeded with the
  stage's seed ``+ 314159 + cp_rank``: the same on the TP ranks of a CP rank, different across
  CP ranks. Everything outside attention runs on the CP rank's chunk of the sequence, so the
  residual-stream dropout of one chunk must not repeat its CP peers' masks
  (``sequence_chunk_rng``).

The tracker is DeepSpeed's own object, so ``deepspeed.checkpointing`` saves and
restores every stream around a recomputed segment and dropout under
activation checkpointing draws exactly the masks of the first pass.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

from .state import get_parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"  # the name deepspeed.checkpointing forks by default
CONTEXT_PARALLEL_RNG = "context-parallel-rng"
_TP_OFFSET = 2718
_PP_OFFSET = 100
_CP_OFFSET = 314159  # far from the model-parallel seeds (the tracker refuses a seed twice)


def get_rng_tracker():
    return get_cuda_rng_tracker()


def model_parallel_seed(seed: int) -> None:
    """Seed every stream of this rank from ``seed`` (call after initialize_model_parallel)."""
    state = get_parallel_state()
    stage_seed = seed + _PP_OFFSET * state.get_pipe_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)  # also seeds every CUDA device
    tracker = get_rng_tracker()
    tracker.reset()
    tp, cp_rank = state.get_model_parallel_world_size(), state.get_context_parallel_rank()
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + _TP_OFFSET + state.get_model_parallel_rank() + tp * cp_rank)
    if state.get_context_parallel_world_size() > 1:
        tracker.add(CONTEXT_PARALLEL_RNG, stage_seed + _CP_OFFSET + cp_rank)


def tensor_parallel_rng():
    """Context for random draws on TP-split activations (attention-probability dropout)."""
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG in tracker.get_states():
        return tracker.fork(MODEL_PARALLEL_RNG)
    if get_parallel_state().get_model_parallel_world_size() > 1:
        raise RuntimeError("dropout in a tensor-parallel region needs the model-parallel RNG: "
                           "call models.parallel.model_parallel_seed(seed) after initialize_model_parallel()")
    return contextlib.nullcontext()  # one TP rank, never seeded: the default stream will do


def sequence_chunk_rng(sequence_parallel: bool):
    """Context for random draws on the residual stream: this rank's own stream where the activations are split
    along the sequence (by TP under sequence parallelism, by CP under context parallelism), else the default."""
    if sequence_parallel:
        return tensor_parallel_rng()
    tracker = get_rng_tracker()
    if CONTEXT_PARALLEL_RNG in tracker.get_states():  # seeded at CP > 1 only
        return tracker.fork(CONTEXT_PARALLEL_RNG)
    if get_parallel_state().get_context_parallel_world_size() > 1:
        raise RuntimeError("dropout under context parallelism needs the context-parallel RNG: "
                           "call models.parallel.model_parallel_seed(seed) after initialize_model_parallel()")
    return contextlib.nullcontext()
