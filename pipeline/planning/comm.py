"""The collectives of one optimizer step, analytically, and their time on a link.

Per micro-batch of ``b`` sequences of ``s`` tokens, ``M = b s h`` activation elements:

    TP, per layer:  forward 2 all-reduces of M (Megatron's two g), backward 2 (its two f); full
                    recomputation repeats the forward's. The embedding adds one in the forward (first stage),
                    the output layer one in the backward (last stage), the vocab-parallel cross-entropy
                    all-reduces its per-token max and sums (b s fp32 values, twice).
    TP + SP:        each all-reduce becomes an all-gather (out M) or a reduce-scatter (in M); the backward
                    all-gathers the two column-parallel inputs again for the weight gradients.
    PP:             per micro-batch and stage boundary a send of the activation (M/t under TP: sequence-split
                    under SP, else split by DeepSpeed and all-gathered over TP on arrival) forward and of its
                    gradient backward; a tied embedding's gradient all-reduced between the end stages.
    DP:             ZeRO-0 all-reduces the gradients once per step; ZeRO-1/2 (DeepSpeed 0.19.8) all-reduce
                    them every micro-batch, bucket by bucket (a bucket that spans several ranks' partitions
                    is all-reduced, not reduce-scattered: up to 2x the minimum), and all-gather the updated
                    weights once; ZeRO-3 all-gathers the weights in
                    every forward (and again in the backward once the stage holds more than DeepSpeed's
                    ``stage3_max_live_parameters``, 1e9) and reduce-scatters the gradients every micro-batch.

A ring over ``n`` ranks sends ``2 (n-1)/n`` of the message per rank for an all-reduce and ``(n-1)/n`` for an
all-gather or reduce-scatter, in ``2 (n-1)`` or ``n-1`` steps of the link's latency.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import Link


@dataclass(frozen=True)
class Collective:
    group: str          # "tp", "pp", "dp"
    op: str             # "all_reduce", "all_gather", "reduce_scatter", "send"
    what: str
    bytes: float        # the message: the all-reduced tensor, the gathered output, the scattered input
    count: float        # per optimizer step, on one GPU
    per: str = "step"   # "micro-batch-layer", "micro-batch", "step": what the time model repeats it over

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


def ring_time(op: str, nbytes: float, n: int, link: Link) -> float:
    if op == "send":
        return nbytes / link.bytes_per_s + link.latency_s
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps / n * nbytes / link.bytes_per_s + steps * link.latency_s


def tp_collectives(b: int, s: int, h: int, act_bytes: int, layers: int, micro_batches: int, sp: bool,
                   recompute_full: bool, first_stage: bool = True, last_stage: bool = True,
                   sp_param_grads: tuple[tuple[int, int], ...] = ()) -> list[Collective]:
    """TP collectives of one step on one GPU of a stage holding ``layers`` layers. An all-gather's ``bytes`` is
    its gathered output (DeepSpeed's comms logger records the local chunk, ``bytes / t``). ``sp_param_grads``:
    (elements, count per micro-batch) of the replicated parameters whose fp32 gradients SP sums over TP
    (norms, row-parallel biases, gpt2's positions): beyond the minimum."""
    M = b * s * h * act_bytes
    n = layers * micro_batches
    fwd_passes = 2 if recompute_full else 1
    out = []
    if sp:
        out += [Collective("tp", "all_gather", "QKV and MLP inputs (forward)", M, 2 * fwd_passes * n),
                Collective("tp", "reduce_scatter", "attention and MLP outputs (forward)", M, 2 * fwd_passes * n),
                Collective("tp", "reduce_scatter", "input gradients of QKV and MLP (backward)", M, 2 * n),
                Collective("tp", "all_gather", "output gradients of the row-parallel layers (backward)", M, 2 * n),
                Collective("tp", "all_gather", "QKV and MLP inputs again for the weight gradients", M, 2 * n)]
    else:
        out += [Collective("tp", "all_reduce", "attention and MLP outputs (forward g)", M, 2 * fwd_passes * n),
                Collective("tp", "all_reduce", "input gradients (backward f)", M, 2 * n)]
    if first_stage:
        out.append(Collective("tp", "reduce_scatter" if sp else "all_reduce", "vocab-parallel embedding (forward)",
                              M, micro_batches))
        if sp:
            out.append(Collective("tp", "all_gather", "its gradient (backward)", M, micro_batches))
    if last_stage:
        if sp:
            out += [Collective("tp", "all_gather", "hidden states into the output layer, forward and again in the "
                               "backward", M, 2 * micro_batches),
                    Collective("tp", "reduce_scatter", "their gradient", M, micro_batches)]
        else:
            out.append(Collective("tp", "all_reduce", "output layer input gradient (backward f)", M, micro_batches))
        out += [Collective("tp", "all_reduce", "cross-entropy max (fp32)", 4 * b * s, micro_batches),
                Collective("tp", "all_reduce", "cross-entropy sum of exp and target logit (fp32)", 8 * b * s,
                           micro_batches)]
    for elements, count in (sp_param_grads if sp else ()):
        out.append(Collective("tp", "all_reduce", "fp32 gradient of a replicated parameter (SP)", 4 * elements,
                              count * micro_batches))
    return out


def pp_collectives(b: int, s: int, h: int, act_bytes: int, micro_batches: int, tp: int, sp: bool,
                   stages: int, stage: str | None = None, tied_grad_bytes: float = 0) -> list[Collective]:
    """PP collectives of one step on one GPU of ``stage`` ("first", "last", None: a middle one), one message
    each way per micro-batch. Without SP, DeepSpeed's pipeline engine sends 1/t of each activation and its
    gradient (``pipe_partitioned``, Megatron 2021's scatter-gather) and all-gathers it over TP on arrival; the
    sending stage also re-gathers its own output for the backward (it keeps only its part meanwhile). A tied
    embedding's gradient is all-reduced between the first and the last stage once per step."""
    if stages <= 1:
        return []
    M = b * s * h * act_bytes
    partitioned = tp > 1 and not sp
    out = [Collective("pp", "send", "activations forward", M / tp if sp or partitioned else M, micro_batches),
           Collective("pp", "send", "their gradients backward", M / tp if sp or partitioned else M, micro_batches)]
    if partitioned:
        gathers = {"first": 2, "last": 1}.get(stage, 3)
        out.append(Collective("tp", "all_gather", "pipeline messages joined on arrival (and the stage's own "
                              "output again for the backward)", M, gathers * micro_batches))
    if tied_grad_bytes and stage in ("first", "last", None):
        out.append(Collective("pp", "all_reduce", "tied embedding gradient (first and last stage)",
                              tied_grad_bytes, 1))
    return out


def dp_collectives(psi: float, zero: int, micro_batches: int, weight_bytes: int, grad_bytes: int,
                   dp: int, max_live: float = 1e9) -> list[Collective]:
    """Data-parallel collectives of one step on one GPU holding ``psi`` parameters (after TP and PP)."""
    if dp <= 1:
        return []
    if zero == 0:
        return [Collective("dp", "all_reduce", "gradients", psi * grad_bytes, 1)]
    if zero in (1, 2):  # DeepSpeed all-reduces a bucket that spans several ranks' partitions (a minimum: RS)
        return [Collective("dp", "all_reduce", "gradients", psi * grad_bytes, micro_batches),
                Collective("dp", "all_gather", "updated weights", psi * weight_bytes, 1)]
    out = [Collective("dp", "all_gather", "weights (forward)", psi * weight_bytes, micro_batches),
           Collective("dp", "reduce_scatter", "gradients", psi * grad_bytes, micro_batches)]
    if psi > max_live:  # DeepSpeed keeps gathered weights for the backward while they fit in max_live
        out.append(Collective("dp", "all_gather", "weights again (backward)", psi * weight_bytes, micro_batches))
    return out
