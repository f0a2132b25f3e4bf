"""What ``python -m pipeline.plan`` does: read the model, check what the user pinned, rank the layouts that fit,
and format the table (or the validation against the papers)."""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from pipeline.job.errors import UserError
from pipeline.job.families import family_of_dict
from pipeline.job.files import read_json_object
from pipeline.job.model_configs import read_model_config

from .explain import deepspeed_command, explanation, fold, folded_label, headroom_bytes
from .hardware import hardware
from .layouts import Job, Prediction, divisors, fits, iter_layouts, predict
from .shapes import ModelShape
from .validation import Row

GIB = 2**30
MAX_LAYOUTS = 100_000  # about a minute of predictions; a real cluster and batch give a few thousand


class PlanError(UserError, ValueError):
    pass


def load_shape(spec: str, seq: int | None) -> ModelShape:
    if Path(spec).is_file():
        read_json_object(spec, "--model-config")  # one line for a file that is not a JSON object
    raw = read_model_config(spec)
    source = raw.pop("_source")
    family = family_of_dict(raw, source)
    if seq is not None:
        raw["seq_length"] = seq
        if "max_position_embeddings" in {f.name for f in dataclasses.fields(family.config_class)}:
            raw["max_position_embeddings"] = max(seq, raw.get("max_position_embeddings", seq))
    config = family.config_class.from_dict(raw, source=source)
    if getattr(config, "num_experts", 0):
        raise PlanError(f"{source}: num_experts {config.num_experts}: the planner models dense layers only (no "
                        f"expert parallelism, router or all-to-all); plan the dense model of the same width, or "
                        f"size the MoE run by hand (docs/moe.md)")
    return family.shape(config, spec, seq)


def check_pinned(job: Job, pinned: dict) -> None:
    """One line for a pinned size that cannot work, before any search."""
    m, n = job.model, job.gpus
    for flag in ("tp", "pp"):
        v = pinned.get(flag)
        if v is not None and (v < 1 or n % v):
            raise PlanError(f"--{flag} {v}: does not divide --gpus {n}; choose one of "
                            f"{', '.join(map(str, divisors(n)))}")
    tp, pp = pinned.get("tp", 1), pinned.get("pp", 1)
    if n % (tp * pp):
        raise PlanError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide --gpus {n}; choose sizes whose "
                        f"product divides {n}")
    if not m.recurrent:
        for name, value in (("num_heads", m.heads), ("num_kv_heads", m.kv_heads), ("ffn_hidden_size", m.ffn)):
            if value % tp:
                raise PlanError(f"--tp {tp}: {name} {value} of {m.name} is not divisible by {tp}; choose a "
                                f"TP size that divides it")
    if pp > m.layers:
        raise PlanError(f"--pp {pp}: more stages than the {m.layers} layers of {m.name}; choose --pp <= {m.layers}")
    dp = n // (tp * pp)
    if "tp" in pinned and "pp" in pinned and job.global_batch % dp:
        raise PlanError(f"--global-batch-size {job.global_batch}: not divisible by the {dp} data-parallel "
                        f"replicas of TP {tp} x PP {pp} on {n} GPUs; choose a multiple of {dp}")


def rank_layouts(job: Job, pinned: dict) -> tuple[list[Prediction], int, list[Prediction]]:
    """(the predictions of the layouts that fit, fastest first; how many were tried; the layouts faster than
    the fastest that fits, left out for memory)."""
    check_pinned(job, pinned)
    candidates = list(itertools.islice(iter_layouts(job, pinned), MAX_LAYOUTS + 1))
    if len(candidates) > MAX_LAYOUTS:
        raise PlanError(f"--gpus {job.gpus}, --global-batch-size {job.global_batch}: more than {MAX_LAYOUTS} "
                        f"layouts to try; pin some of --tp, --pp, --micro-batch, --zero to narrow the search")
    if not candidates:
        raise PlanError(f"--gpus {job.gpus}, --global-batch-size {job.global_batch}: no layout of {job.model.name} "
                        f"divides them (with the sizes pinned); choose a batch that is a multiple of the GPU count")
    preds = [predict(job, lay) for lay in candidates]
    feasible = sorted((p for p in preds if fits(job, p)), key=lambda p: (round(p.step_s, 6), p.memory_total))
    if not feasible:
        least = min(preds, key=lambda p: p.memory_total)
        raise PlanError(f"{job.model.name}: no layout fits in {job.hardware.hbm_bytes / GIB:.0f} GiB per GPU of "
                        f"{job.hardware.name} on {job.gpus} GPUs; the smallest, {least.layout.label()}, needs "
                        f"{least.memory_total / GIB:.1f} GiB; use more GPUs, a shorter sequence or a larger GPU")
    excluded = [p for p in preds if not fits(job, p) and round(p.step_s, 6) < round(feasible[0].step_s, 6)]
    return feasible, len(candidates), excluded


def format_plan(job: Job, feasible: list[Prediction], tried: int, top: int, excluded: list[Prediction],
                model_config: str) -> str:
    """The table (identical rows folded), why the first row, and the command line that trains it."""
    m, hw = job.model, job.hardware
    lines = [f"# {m.name}: {m.params / 1e9:.2f}B parameters, {m.seq} tokens x {job.global_batch} sequences per step, "
             f"{job.precision}, on {job.gpus} x {hw.name} ({hw.description}); {len(feasible)} of {tried} layouts fit",
             f"# matmuls at {hw.sustained_flops / 1e12:.0f} TFLOP/s per GPU (peak {hw.peak_flops / 1e12:.0f}); "
             f"memory: weights + gradients + optimizer + activations, GiB per GPU of the fullest stage",
             "| rank | layout | memory GiB (w + g + o + act) | headroom GiB | step s | compute | TP comm | PP comm | "
             "bubble | DP exposed | tokens/s | MFU |", "| --- " * 12 + "|"]
    for i, (p, same) in enumerate(fold(job, feasible)[:top], 1):
        mem, t = p.memory, p.times
        lines.append(f"| {i} | {folded_label(p, same)} | {p.memory_total / GIB:.1f} ({mem['weights'] / GIB:.1f} + "
                     f"{mem['gradients'] / GIB:.1f} + {mem['optimizer'] / GIB:.1f} + {mem['activations'] / GIB:.1f}) "
                     f"| {headroom_bytes(job, p) / GIB:.1f} | {p.step_s:.3f} | {t['compute']:.3f} | {t['tp_comm']:.3f} "
                     f"| {t['pp_comm']:.3f} | {t['bubble']:.3f} | {t['dp_exposed']:.3f} | {p.tokens_per_s:,.0f} | "
                     f"{100 * p.mfu:.1f}% |")
    lines += explanation(job, feasible[0], excluded)
    lines += ["# train rank 1:", deepspeed_command(job, feasible[0], model_config)]
    return "\n".join(lines)


def format_validation(rows: list[Row]) -> str:
    lines = ["| published result | published | predicted | difference | tolerance | within |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.name} | {r.published:.1f}{r.unit} | {r.predicted:.1f}{r.unit} | {r.difference:+.1f}"
                     f"{r.unit} | +-{r.tolerance:.1f}{r.unit} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


def make_job(spec: str, gpus: int, hardware_name: str, seq: int | None, global_batch: int | None,
             precision: str, sustained_tflops: float | None, bucket: float) -> Job:
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: must be at least 1")
    hw = hardware(hardware_name).with_sustained(sustained_tflops)
    shape = load_shape(spec, seq)
    batch = global_batch or max(gpus, 8)
    return Job(shape, hw, gpus=gpus, global_batch=batch, precision=precision, bucket=bucket,
               overlap_dp=not shape.recurrent)
