"""Layouts (TP, PP, DP, ZeRO, SP, recomputation, micro-batch), their predicted memory and step time, ranked.

Step time of one GPU of the fullest stage (docs/performance.md has the assumptions):

    per micro-batch   matmul FLOPs / (t p) at the sustained rate, plus the element-wise passes over the
                      [b, s, h] activations at HBM bandwidth (replicated on every TP rank unless SP), plus
                      the TP collectives (synchronous) and the two pipeline sends
    1F1B pipeline     (m + p - 1) micro-batch times: the bubble is (p - 1) of them
    data parallel     the gradient reduction overlaps the backward (ZeRO-3's gathers the whole step); what
                      does not fit, and the last bucket, is exposed; ZeRO-1/2's weight all-gather after
                      the optimizer step is not overlapped
    optimizer         Adam's pass over its (partition of the) states at HBM bandwidth
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .comm import Collective, dp_collectives, pp_collectives, ring_time, tp_collectives
from .hardware import Hardware
from .memory import PRECISION_BYTES, RECOMPUTE_MODULES, SELECTIVE_DEFAULT, activations, model_states
from .shapes import ModelShape

ELEMENTWISE_PASSES = {"forward": 12, "backward": 24}  # reads + writes of [b, s, h] per layer (norms, dropout, adds)
ADAM_BYTES_PER_PARAM = 36  # read and write fp32 master, m, v (24), read the gradient, write the 16-bit weight
DEFAULT_BUCKET = 5e8       # DeepSpeed's reduce_bucket_size (elements)
# (policy, selective modules) the planner tries: Megatron-Core's default and every module
RECOMPUTE_CHOICES = (("none", ()), ("selective", SELECTIVE_DEFAULT), ("selective", RECOMPUTE_MODULES), ("full", ()))


@dataclass(frozen=True)
class Candidate:
    """One layout the planner weighs, with its micro-batch (the job's ``models.parallel.Layout`` is what a run
    takes; this is the planner's coarser view of one: no CP, EP or tiling yet)."""
    tp: int
    pp: int
    dp: int
    zero: int
    sp: bool
    recompute: str
    micro_batch: int
    recompute_modules: tuple = ()  # of selective (default: SELECTIVE_DEFAULT), in RECOMPUTE_MODULES' order

    def __post_init__(self):
        if self.recompute == "selective" and not self.recompute_modules:
            object.__setattr__(self, "recompute_modules", SELECTIVE_DEFAULT)

    def label(self) -> str:
        modules = f"({','.join(self.recompute_modules)})" if self.recompute == "selective" else ""
        return (f"TP{self.tp} PP{self.pp} DP{self.dp} ZeRO-{self.zero}{' SP' if self.sp else ''} "
                f"recompute={self.recompute}{modules} mb={self.micro_batch}")


@dataclass(frozen=True)
class Job:
    model: ModelShape
    hardware: Hardware
    gpus: int
    global_batch: int
    precision: str = "bf16"
    bucket: float = DEFAULT_BUCKET
    overlap_dp: bool = True          # False: the gradients are reduced after the backward (a recurrence)
    reduce_bytes: int | None = None  # bytes per gradient element on the wire (default: the gradient's)
    memory_reserve: float = 0.1      # of HBM kept for the CUDA context, NCCL buffers, fragmentation


@dataclass
class Prediction:
    layout: Candidate
    memory: dict
    times: dict
    step_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    collectives: list[Collective] = field(default_factory=list)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


def micro_batches(job: Job, lay: Candidate) -> int:
    return job.global_batch // (lay.dp * lay.micro_batch)


def predict_memory(job: Job, lay: Candidate) -> dict:
    psi = job.model.stage_params(lay.tp, lay.pp)
    states = model_states(psi, lay.zero, lay.dp, job.precision)
    act = activations(job.model, lay.micro_batch, lay.tp, lay.pp, lay.sp, lay.recompute,
                      micro_batches(job, lay), job.precision, lay.recompute_modules)
    return {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
            "activations": act}


def _compute_s(job: Job, lay: Candidate) -> tuple[float, float]:
    """(forward + backward compute of one micro-batch on one GPU, of which the backward)."""
    m, hw = job.model, job.hardware
    tokens = lay.micro_batch * m.seq
    core_attn = "core_attn" in lay.recompute_modules
    extra = {"none": 0.0, "selective": m.attention_flops_per_token / 3 * core_attn, "full": m.flops_per_token / 3}
    matmul = (m.flops_per_token + extra[lay.recompute]) * tokens / (lay.tp * lay.pp) / hw.sustained_flops
    passes = ELEMENTWISE_PASSES["forward"] * (2 if lay.recompute == "full" else 1) + ELEMENTWISE_PASSES["backward"]
    # recomputed norms read and write [b, s, h] twice more (/t with SP); the MLP activation reads its input
    # (2f wide gated) and writes f, split by TP
    passes += 4 * ("layernorm" in lay.recompute_modules)
    act_passes = ((3 if m.gated_mlp else 2) * m.ffn / m.hidden / lay.tp) * ("mlp_act" in lay.recompute_modules)
    act_bytes = PRECISION_BYTES[job.precision][0]
    layers = -(-m.layers // lay.pp)
    elementwise = 0.0 if m.recurrent else ((passes / (lay.tp if lay.sp else 1) + act_passes)
                                           * tokens * m.hidden * act_bytes * layers / hw.hbm_bytes_per_s)
    total = matmul + elementwise
    backward_share = (3 if lay.recompute == "full" else 2) / (4 if lay.recompute == "full" else 3)
    return total, total * backward_share


def step_collectives(job: Job, lay: Candidate, stage: str | None = None) -> list[Collective]:
    """One GPU's collectives of a step on pipeline ``stage`` ("first", "last"; None: the stage the planner
    times, a middle one for the sends and the last for the TP collectives and the DP bytes of the fullest)."""
    m, mb = job.model, micro_batches(job, lay)
    w, g, _ = PRECISION_BYTES[job.precision]
    act = w
    first, last = lay.pp == 1 or stage == "first", lay.pp == 1 or stage in ("last", None)
    out = []
    if lay.tp > 1:
        layers = -(-m.layers // lay.pp)
        outside = tuple(e for e in m.replicated_outside if (e == m.hidden and last) or (e != m.hidden and first))
        grads = tuple((e, layers) for e in m.replicated_per_layer) + tuple((e, 1) for e in outside)
        out += tp_collectives(lay.micro_batch, m.seq, m.hidden, act, layers, mb, lay.sp, lay.recompute == "full",
                              first_stage=first, last_stage=last, sp_param_grads=grads)
    tied = (m.hidden * m.vocab / lay.tp * (job.reduce_bytes or g)) if m.tied and not m.recurrent else 0
    out += pp_collectives(lay.micro_batch, m.seq, m.hidden, act, mb, lay.tp, lay.sp, lay.pp, stage, tied)
    out += dp_collectives(m.stage_params(lay.tp, lay.pp, stage), lay.zero, mb, w, job.reduce_bytes or g, lay.dp)
    return out


def _comm_s(job: Job, lay: Candidate, colls: list[Collective]) -> dict:
    hw = job.hardware
    links = {"tp": (lay.tp, hw.link(lay.tp, 1)), "pp": (lay.pp, hw.link(lay.pp, lay.tp)),
             "dp": (lay.dp, hw.link(lay.dp, lay.tp * lay.pp))}
    out = {"tp": 0.0, "pp": 0.0, "dp_overlappable": 0.0, "dp_after": 0.0, "dp_bucket": 0.0}
    for c in colls:
        n, link = links[c.group]
        t = ring_time(c.op, c.bytes, n, link) * c.count
        if c.group != "dp":
            out[c.group] += t
        elif c.what == "updated weights":
            out["dp_after"] += t
        else:
            out["dp_overlappable"] += t
            bucket_bytes = min(c.bytes, job.bucket * c.bytes / max(1.0, job.model.stage_params(lay.tp, lay.pp)))
            out["dp_bucket"] = max(out["dp_bucket"], ring_time(c.op, bucket_bytes, n, link))
    return out


def predict(job: Job, lay: Candidate) -> Prediction:
    m, hw = job.model, job.hardware
    mb = micro_batches(job, lay)
    colls = step_collectives(job, lay)
    comm = _comm_s(job, lay, colls)
    compute, backward = _compute_s(job, lay)
    per_mb = compute + comm["tp"] / mb + comm["pp"] / mb
    pipeline = (mb + lay.pp - 1) * per_mb
    if job.overlap_dp:
        window = (mb * compute) if lay.zero == 3 else (backward * (mb if lay.zero in (1, 2) else 1))
        dp_exposed = max(comm["dp_overlappable"] - window, comm["dp_bucket"])
    else:
        dp_exposed = comm["dp_overlappable"]
    psi = m.stage_params(lay.tp, lay.pp)
    optimizer = ADAM_BYTES_PER_PARAM * psi / (lay.dp if lay.zero >= 1 else 1) / hw.hbm_bytes_per_s
    step = pipeline + dp_exposed + comm["dp_after"] + optimizer
    times = {"compute": mb * compute, "tp_comm": comm["tp"], "pp_comm": comm["pp"],
             "bubble": (lay.pp - 1) * per_mb, "dp_exposed": dp_exposed + comm["dp_after"], "optimizer": optimizer}
    tokens = job.global_batch * m.seq / step
    model_flops = m.flops_per_token * tokens / job.gpus
    return Prediction(layout=lay, memory=predict_memory(job, lay), times=times, step_s=step, tokens_per_s=tokens,
                      model_tflops_per_gpu=model_flops / 1e12, mfu=model_flops / hw.peak_flops, collectives=colls)


def fits(job: Job, p: Prediction) -> bool:
    return p.memory_total <= job.hardware.hbm_bytes * (1 - job.memory_reserve)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in sqrt(n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidate_layouts(job: Job, pinned: dict) -> list[Candidate]:
    """Every layout the model, the GPU count and the batch allow (``pinned``: fields fixed by the user)."""
    return list(iter_layouts(job, pinned))


def iter_layouts(job: Job, pinned: dict) -> Iterator[Candidate]:
    """``candidate_layouts`` one at a time (the pinned sizes narrow the loops, not only the result)."""
    m = job.model

    def allowed(name: str, values) -> list:
        return [v for v in values if pinned.get(name, v) == v]

    tps = [1] if m.recurrent else [t for t in divisors(job.gpus) if t <= job.hardware.gpus_per_server
                                         and m.heads % t == 0 and m.kv_heads % t == 0 and m.ffn % t == 0]
    for tp in allowed("tp", tps):
        for pp in allowed("pp", [1] if m.recurrent else divisors(job.gpus // tp)):
            if pp > m.layers:
                continue
            dp = job.gpus // (tp * pp)
            if job.global_batch % dp:
                continue
            for mbs in allowed("micro_batch", divisors(job.global_batch // dp)):
                for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                    for sp in ((False, True) if tp > 1 and m.seq % tp == 0 else (False,)):
                        for policy, modules in ((("none", ()),) if m.recurrent else RECOMPUTE_CHOICES):
                            lay = Candidate(tp, pp, dp, zero, sp, policy, mbs, modules)
                            if all(getattr(lay, k) == v for k, v in pinned.items()):
                                yield lay
