"""Model-parallel RNG: two random streams, as in Megatron-LM.

* The default stream is seeded with ``seed + 100 x pp_rank`` (the stage's seed):
  identical on the TP ranks of a stage, so dropout on replicated activations
  (residual, embedding) draws the same mask everywhere they are replicated.
* The tracked "model-parallel" stream is seeded with the stage's seed ``+ 2718 + tp_rank``:
  it differs across TP ranks (each rank drops different heads' probabilities)
  and is the same on every data-parallel replica. Code in a TP region draws
  from it inside ``get_rng_tracker().fork()``.

The tracker is DeepSpeed's own object, so ``deepspeed.checkpointing`` saves and
restores both streams around a recomputed segment and dropout under
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
_TP_OFFSET = 2718
_PP_OFFSET = 100


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
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + _TP_OFFSET + state.get_model_parallel_rank())


def tensor_parallel_rng():
    """Context for random draws on TP-split activations (attention-probability dropout)."""
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG in tracker.get_states():
        return tracker.fork(MODEL_PARALLEL_RNG)
    if get_parallel_state().get_model_parallel_world_size() > 1:
        raise RuntimeError("dropout in a tensor-parallel region needs the model-parallel RNG: "
                           "call models.parallel.model_parallel_seed(seed) after initialize_model_parallel()")
    return contextlib.nullcontext()  # one TP rank, never seeded: the default stream will do
