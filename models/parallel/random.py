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
activation checkpointing draws exactly the masks of the first pass. Models draw through
``dropout_from`` and ``causal_attention_from``, which in a compiled region fork the stream inside a custom op
(``mds::stream_*``), so the tracker does not break the graph and compiled blocks drop what eager ones do.
"""
from __future__ import annotations

import contextlib
import functools
import random

import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

from .plain_attention import short_causal_attention
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


def _is_tracked(stream: str) -> bool:
    return stream in get_rng_tracker().states_  # not get_states(): Dynamo cannot trace its copy of the dict


def tensor_parallel_stream() -> str | None:
    """The stream of random draws on TP-split activations (attention-probability dropout); None: the default one
    (one TP rank, never seeded)."""
    if _is_tracked(MODEL_PARALLEL_RNG):
        return MODEL_PARALLEL_RNG
    if get_parallel_state().get_model_parallel_world_size() > 1:
        raise RuntimeError("dropout in a tensor-parallel region needs the model-parallel RNG: "
                           "call models.parallel.model_parallel_seed(seed) after initialize_model_parallel()")
    return None


def sequence_chunk_stream(sequence_parallel: bool) -> str | None:
    """The stream of random draws on the residual stream: this rank's own where the activations are split along
    the sequence (by TP under sequence parallelism, by CP under context parallelism), else the default (None)."""
    if sequence_parallel:
        return tensor_parallel_stream()
    if _is_tracked(CONTEXT_PARALLEL_RNG):  # seeded at CP > 1 only
        return CONTEXT_PARALLEL_RNG
    if get_parallel_state().get_context_parallel_world_size() > 1:
        raise RuntimeError("dropout under context parallelism needs the context-parallel RNG: "
                           "call models.parallel.model_parallel_seed(seed) after initialize_model_parallel()")
    return None


def in_stream(stream: str | None):
    """Context whose random draws come from the tracked ``stream`` (None: the default one)."""
    return get_rng_tracker().fork(stream) if stream else contextlib.nullcontext()


def tensor_parallel_rng():
    """Context for random draws on TP-split activations."""
    return in_stream(tensor_parallel_stream())


def sequence_chunk_rng(sequence_parallel: bool):
    """Context for random draws on the residual stream (``sequence_chunk_stream``)."""
    return in_stream(sequence_chunk_stream(sequence_parallel))


# Dropout from a tracked stream inside a compiled region. The tracker swaps the generator's state around a draw,
# which Dynamo cannot trace (10 graph breaks per block); there the draw is a custom op, one opaque node, that forks
# the stream at run time and draws exactly what the eager code draws, so compiled and eager blocks drop the same
# elements. Draws from the default stream stay in the graph (the compiler's own random numbers).

def dropout_from(stream: str | None, x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` dropped with probability ``p`` (training), the mask drawn from ``stream`` (None: the default one)."""
    if stream is None:
        return F.dropout(x, p, True)
    if torch.compiler.is_compiling():
        return x * stream_dropout_scale(x.detach(), p, stream)
    with in_stream(stream):
        return F.dropout(x, p, True)


@torch.library.custom_op("mds::stream_dropout_scale", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def stream_dropout_scale(like: torch.Tensor, p: float, stream: str) -> torch.Tensor:
    """Dropout's mask times 1 / (1 - p), drawn from ``stream`` for a tensor like ``like``: the draws of
    ``F.dropout(like, p)`` (how many, in which order, depend on its shape and dtype only), so ``like`` times it is
    that dropout, bit for bit."""
    with in_stream(stream):
        return F.dropout(torch.ones_like(like), p, True)


@stream_dropout_scale.register_fake
def _(like, p, stream):
    return torch.empty_like(like)


# devices whose SDPA with dropout is its math path (neither fused kernel drops on a CPU)
MATH_ATTENTION_DEVICES = ("cpu",)


def causal_attention_from(stream: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                          enable_gqa: bool = False, recompute=None) -> torch.Tensor:
    """Causal SDPA of [b, heads, s, d] with attention dropout ``p``, its mask drawn from ``stream``. Compiled, where
    SDPA with dropout is its math path, that math in the graph with the mask drawn by a custom op; elsewhere one
    custom op around the fused kernel, whose backward replays the stream's state of the forward and recomputes the
    attention to differentiate it (one more attention forward per step, not a graph break). ``recompute(fn,
    *tensors)``: how a compiled region recomputes the attention in its backward (selective recomputation of
    ``core_attn``; eager code wraps this whole call in DeepSpeed's checkpoint instead)."""
    recompute = recompute or _called
    if stream is not None and p and torch.compiler.is_compiling():
        if q.device.type in MATH_ATTENTION_DEVICES:
            # drawn before the recomputed region: the compiler would recompute a draw inside it from the default
            # generator's state, not the stream's
            scores = q.new_empty((*q.shape[:-1], k.shape[-2]), dtype=torch.float32)
            kept = stream_dropout_scale(scores, p, stream) != 0
            return recompute(short_causal_attention, q, k, v, kept, p)  # k, v's heads broadcast
        return stream_attention(q, k, v, p, stream, enable_gqa)[0]  # its backward recomputes it already
    with in_stream(stream):
        return recompute(functools.partial(F.scaled_dot_product_attention, dropout_p=p, is_causal=True,
                                           enable_gqa=enable_gqa), q, k, v)


def _called(fn, *args):
    return fn(*args)


def _rng_state_size() -> int:
    return get_accelerator().get_rng_state().numel()


@contextlib.contextmanager
def _replayed(state: torch.Tensor):
    """The default generator at ``state`` for the draws inside, then back where it was."""
    accelerator = get_accelerator()
    kept = accelerator.get_rng_state()
    accelerator.set_rng_state(state)
    try:
        yield
    finally:
        accelerator.set_rng_state(kept)


@torch.library.custom_op("mds::stream_attention", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, stream: str,
                     enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal attention with dropout ``p`` drawn from ``stream``, the generator's state it was drawn from)."""
    state = get_rng_tracker().get_states()[stream].clone()
    with in_stream(stream):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=enable_gqa)
    return out.contiguous(), state  # contiguous, as the fake says (the compiled graph views it by those strides)


@stream_attention.register_fake
def _(q, k, v, p, stream, enable_gqa):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), torch.empty(_rng_state_size(), dtype=torch.uint8)


@torch.library.custom_op("mds::stream_attention_backward", mutates_args=())
def stream_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              state: torch.Tensor, p: float, enable_gqa: bool) -> list[torch.Tensor]:
    """The gradients of ``stream_attention`` for q, k, v: its forward recomputed on the same dropout mask (through
    ``torch.func.vjp``: the autograd engine does not record inside a custom op)."""
    def attention(*qkv):
        return F.scaled_dot_product_attention(*qkv, dropout_p=p, is_causal=True, enable_gqa=enable_gqa)

    with _replayed(state):
        _, vjp = torch.func.vjp(attention, q, k, v)
    return [g.contiguous() for g in vjp(grad)]


@stream_attention_backward.register_fake
def _(grad, q, k, v, state, p, enable_gqa):
    return [t.new_empty(t.shape) for t in (q, k, v)]


def _attention_setup(ctx, inputs, output):
    q, k, v, p, _, enable_gqa = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.p, ctx.enable_gqa = p, enable_gqa


def _attention_backward(ctx, grad, _):
    q, k, v, state = ctx.saved_tensors
    dq, dk, dv = stream_attention_backward(grad, q, k, v, state, ctx.p, ctx.enable_gqa)
    return dq, dk, dv, None, None, None


stream_attention.register_autograd(_attention_backward, setup_context=_attention_setup)
