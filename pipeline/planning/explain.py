"""What the plan says beside its table: identical rows folded into one, which limit binds the top layout
(memory, the pipeline bubble, communication), its headroom against the GPU's memory, and the exact ``deepspeed``
command line of ``pipeline/pretrain.py`` that trains it."""
from __future__ import annotations

from .layouts import Job, Prediction

GIB = 2**30
COMPUTE_BOUND = 0.95  # a step whose compute is at least this share of it is bound by the matmul rate,
MINOR_OVERHEAD = 0.10  # as is one whose largest overhead is under this share of it (that overhead binds nothing)
# the ds_configs/ file of a (precision, ZeRO stage) without a pipeline; a pipeline takes pipeline_bf16_zero1.json
DS_CONFIGS = {("bf16", 1): "bf16_zero1.json", ("bf16", 2): "bf16_zero2.json", ("bf16", 3): "zero3.json",
              ("fp16", 1): "fp16_zero1.json"}


def usable_bytes(job: Job) -> float:
    return job.hardware.hbm_bytes * (1 - job.memory_reserve)


def headroom_bytes(job: Job, p: Prediction) -> float:
    return usable_bytes(job) - p.memory_total


def row_key(job: Job, p: Prediction) -> tuple:
    """What a table row shows, as shown: two layouts with the same key print the same numbers."""
    return (tuple(round(v / GIB, 1) for v in p.memory.values()), tuple(round(v, 3) for v in p.times.values()),
            round(p.step_s, 3), round(p.tokens_per_s))


def fold(job: Job, feasible: list[Prediction]) -> list[tuple[Prediction, list[Prediction]]]:
    """The ranked predictions with each run of identical rows folded: (the first, the others it stands for)."""
    rows: list[tuple[Prediction, list[Prediction]]] = []
    for p in feasible:
        if rows and row_key(job, rows[-1][0]) == row_key(job, p):
            rows[-1][1].append(p)
        else:
            rows.append((p, []))
    return rows


def folded_label(first: Prediction, others: list[Prediction]) -> str:
    """``first``'s label, then what differs in each of the others (e.g. ``... (same: ZeRO-2)``)."""
    mine = set(first.layout.label().split())
    alternatives = [" ".join(w for w in o.layout.label().split() if w not in mine) or o.layout.label()
                    for o in others]
    return first.layout.label() + (f" (same: {'; '.join(alternatives)})" if alternatives else "")


def overheads(p: Prediction) -> dict:
    """The step's time beyond its compute, by the limit it comes from (seconds)."""
    t = p.times
    return {"communication": t["tp_comm"] + t["pp_comm"] + t["dp_exposed"], "the pipeline bubble": t["bubble"],
            "the optimizer": t["optimizer"]}


def binding_limit(best: Prediction, excluded: list[Prediction]) -> str:
    """``memory`` when a faster layout did not fit, ``compute`` when the step is almost all compute or no overhead
    is a noticeable share of it, else the largest of the step's overheads."""
    if excluded:
        return "memory"
    name, seconds = max(overheads(best).items(), key=lambda kv: kv[1])
    if best.times["compute"] >= COMPUTE_BOUND * best.step_s or seconds < MINOR_OVERHEAD * best.step_s:
        return "compute"
    return name


def explanation(job: Job, best: Prediction, excluded: list[Prediction]) -> list[str]:
    """Comment lines on the top layout: the limit that binds, the time by limit, the memory headroom."""
    t, limit = best.times, binding_limit(best, excluded)
    lines = [f"# rank 1 is bound by {limit}: compute is {100 * t['compute'] / best.step_s:.0f}% of its "
             f"{best.step_s:.3f} s step; communication {overheads(best)['communication']:.3f} s (TP "
             f"{t['tp_comm']:.3f}, PP {t['pp_comm']:.3f}, DP exposed {t['dp_exposed']:.3f}), pipeline bubble "
             f"{t['bubble']:.3f} s, optimizer {t['optimizer']:.3f} s"]
    if excluded:
        fastest = min(excluded, key=lambda p: p.step_s)
        lines.append(f"# memory: {len(excluded)} faster layouts do not fit; the fastest, {fastest.layout.label()} "
                     f"({fastest.step_s:.3f} s), needs {fastest.memory_total / GIB:.1f} GiB of the "
                     f"{usable_bytes(job) / GIB:.1f} usable")
    else:
        lines.append("# memory: no faster layout was left out for memory")
    lines.append(f"# headroom: rank 1 uses {best.memory_total / GIB:.1f} of {usable_bytes(job) / GIB:.1f} GiB usable "
                 f"per GPU ({job.hardware.hbm_bytes / GIB:.0f} GiB less {100 * job.memory_reserve:.0f}% for the "
                 f"CUDA context, NCCL and fragmentation): {headroom_bytes(job, best) / GIB:.1f} GiB free")
    return lines


def ds_config_for(job: Job, p: Prediction) -> tuple[str, str]:
    """(the ds_configs/ file for the layout, what to change in a copy of it, or "")."""
    lay = p.layout
    if lay.pp > 1:
        name, stage, precision = "pipeline_bf16_zero1.json", 1, "bf16"
    else:
        stage = lay.zero if (job.precision, lay.zero) in DS_CONFIGS else 1
        precision = job.precision if (job.precision, stage) in DS_CONFIGS else "bf16"
        name = DS_CONFIGS[(precision, stage)]
    changes = []
    if stage != lay.zero:
        changes.append(f'"zero_optimization": {{"stage": {lay.zero}}}')
    if precision != job.precision:
        changes.append(f"{job.precision} in place of bf16")
    return f"ds_configs/{name}", (f"  # in a copy of it: {', '.join(changes)}" if changes else "")


def deepspeed_command(job: Job, p: Prediction, model_config: str) -> str:
    """The ``deepspeed`` line of ``pipeline/pretrain.py`` for the layout (``--data`` and ``--tokenizer`` are
    the user's)."""
    lay, per_server = p.layout, job.hardware.gpus_per_server
    launch = (f"deepspeed --num_gpus {job.gpus}" if job.gpus <= per_server else
              f"deepspeed --hostfile HOSTFILE --num_nodes {job.gpus // per_server} --num_gpus {per_server}")
    config, note = ds_config_for(job, p)
    flags = [f"--model-config {model_config}", f"--deepspeed_config {config}", f"--tensor-parallel {lay.tp}",
             f"--pipeline-parallel {lay.pp}", *(["--sequence-parallel"] if lay.sp else []),
             f"--micro-batch-size {lay.micro_batch}", f"--global-batch-size {job.global_batch}",
             f"--seq-length {job.model.seq}", f"--recompute {lay.recompute}",
             *([f"--recompute-modules {','.join(lay.recompute_modules)}"] if lay.recompute == "selective" else []),
             "--data DATA --tokenizer TOKENIZER --save runs/RUN"]
    return f"{launch} pipeline/pretrain.py {' '.join(flags)}{note}"
