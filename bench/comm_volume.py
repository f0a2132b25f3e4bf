"""Every collective of one optimizer step, counted by DeepSpeed's comms logger, against the analytic minimum.

tp x pp x dp gloo CPU ranks (2, 4 or 8) train the tests' tiny GPT (tests/engine_utils.py: h 32, 4 layers, 16
tokens, fp32, global batch 8) with ``"comms_logger": {"enabled": true, "prof_all": true}`` at each layout. The project's own
collectives go through ``deepspeed.comm`` (models/parallel/collectives.py) under ``tp/...`` names, beside
ZeRO's and the pipeline engine's. One step's collectives are the log after the second step less the log after the
first, so start-up broadcasts and the pipeline's first-step shape messages drop out.

Analytic: ``pipeline.planning.layouts.step_collectives`` (the planner's list, docs/performance.md). Bytes are
as the logger records them (an all-gather's local input, a reduce-scatter's full input, an all-reduce's
tensor, a send's tensor). Collectives the analytic list does not have are listed separately.

    python bench/comm_volume.py [--layouts tp2,tp2-sp,pp2,dp2-z0,dp2-z1,dp2-z2,dp2-z3,tp2-dp2-z1,...]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import format_table  # noqa: E402

from models import GPTConfig
from pipeline.planning.hardware import hardware
from pipeline.planning.layouts import Job, Candidate, step_collectives
from pipeline.families.gpt.shape import gpt_shape

LAYOUTS = {  # name: (tp, pp, dp, zero, sp); the world is tp x pp x dp ranks
    "tp2": (2, 1, 1, 0, False), "tp2-sp": (2, 1, 1, 0, True), "pp2": (1, 2, 1, 1, False),
    "dp2-z0": (1, 1, 2, 0, False), "dp2-z1": (1, 1, 2, 1, False), "dp2-z2": (1, 1, 2, 2, False),
    "dp2-z3": (1, 1, 2, 3, False),
    "tp2-dp2-z1": (2, 1, 2, 1, False), "tp2-sp-dp2-z1": (2, 1, 2, 1, True), "pp2-dp2-z1": (1, 2, 2, 1, False),
    "tp2-pp2-z1": (2, 2, 1, 1, False), "tp2-sp-pp2-z1": (2, 2, 1, 1, True), "tp2-dp2-z3": (2, 1, 2, 3, False),
    "tp2-sp-dp2-z3": (2, 1, 2, 3, True),
    "tp2-pp2-dp2-z1": (2, 2, 2, 1, False), "tp2-sp-pp2-dp2-z1": (2, 2, 2, 1, True)}


def world_size(name: str) -> int:
    tp, pp, dp, _, _ = LAYOUTS[name]
    return tp * pp * dp


LOGGED_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "send": "send", "recv": "recv"}


def _counts() -> dict:
    import deepspeed.comm as dc
    return {op: {size: v[0] for size, v in d.items()} for op, d in dc.comms_logger.comms_dict.items()}


def _logs(rank, name: str) -> tuple[dict, dict]:
    """The comms log after the first and after the second step of one engine."""
    import deepspeed.comm as dc
    from engine_utils import train_worker
    tp, pp, _, zero, sp = LAYOUTS[name]
    dc.reset_log()
    zero_cfg = {"stage": zero, **({"stage3_param_persistence_threshold": 0} if zero == 3 else {})}
    logs = []
    train_worker(rank, tp=tp, pp=pp, steps=2, model_overrides={"sequence_parallel": sp},
                 ds_overrides={"comms_logger": {"enabled": True, "prof_all": True}, "zero_optimization": zero_cfg},
                 after_step=lambda: logs.append(_counts()))
    return logs[0], logs[1]


def worker(rank, names) -> dict:
    """Per layout, this rank's collectives of the second step: {(logged name, bytes): count}."""
    out = {}
    for name in names:
        one, two = _logs(rank, name)
        step = Counter()
        for op, sizes in two.items():
            for size, count in sizes.items():
                extra = count - one.get(op, {}).get(size, 0)
                if extra:
                    step[(op, size)] += extra
        out[name] = dict(step)
    return out


def group_of(op: str) -> str:
    return "tp" if op.startswith("tp/") else "pp" if op in ("send", "recv") else "dp/pp/ds"


def _shape():
    from engine_utils import TINY
    return gpt_shape(GPTConfig(**TINY), "tiny")


def analytic(name: str) -> Counter:
    """{(kind, logged bytes): count} of the planner's list for rank 0 of the layout (the first stage)."""
    from engine_utils import BASE_DS
    tp, pp, dp, zero, sp = LAYOUTS[name]
    gb = BASE_DS["train_batch_size"]
    job = Job(_shape(), hardware("h100-dgx"), gpus=world_size(name), global_batch=gb, precision="fp32")
    counts = Counter()
    lay = Candidate(tp, pp, dp, zero, sp, "none", gb // dp)
    for c in step_collectives(job, lay, stage="first" if pp > 1 else None):
        n = {"tp": tp, "pp": pp, "dp": dp}[c.group]
        op = "recv" if c.what.startswith("their gradients") and pp == 2 else c.op
        logged = c.bytes / n if c.op == "all_gather" else c.bytes
        counts[(f"{c.group}:{op}", int(logged))] += c.count
    return counts


def measured_by_kind(name: str, step: dict) -> tuple[Counter, Counter]:
    """(the logged collectives the analytic list models, keyed like ``analytic``; the others). The logger keys
    by name and size, not group: a ``tp/`` name is the project's TP collective; a send or recv the pipeline's
    (but its 72-byte partition metadata); an all-gather or reduce-scatter DP's (ZeRO), or under TP x PP the
    pipeline engine's TP join; an all-reduce of the tied embedding's gradient size the tied stages', one of more
    than 64 bytes DP's (when there is a DP group), the rest DeepSpeed's norms, overflow checks and bookkeeping."""
    from engine_utils import BASE_DS, SEQ
    tp, pp, dp, zero, sp = LAYOUTS[name]
    m = _shape()
    tied = m.hidden * m.vocab // tp * 4 if pp > 1 and m.tied else None
    # under TP x PP (no SP) the pipeline engine all-gathers 1/t of each micro-batch's message over TP
    pipe_join = BASE_DS["train_batch_size"] // dp * SEQ * m.hidden * 4 // tp if pp > 1 and tp > 1 and not sp else None
    modeled, others = Counter(), Counter()
    for (op, size), count in step.items():
        base = LOGGED_OP.get(op.split("/")[-1])
        if op.startswith("tp/"):
            kind = f"tp:{base}"
        elif base in ("send", "recv"):
            kind = f"pp:{base}" if pp > 1 and size > 128 else None
        elif base in ("all_gather", "reduce_scatter"):
            kind = "tp:all_gather" if size == pipe_join and base == "all_gather" else f"dp:{base}" if dp > 1 else None
        elif base == "all_reduce":
            kind = "pp:all_reduce" if size == tied else f"dp:{base}" if dp > 1 and size > 64 else None
        else:
            kind = None
        (modeled if kind else others)[(kind, size) if kind else (op, size)] += count
    return modeled, others


def _run(names: list[str]) -> dict:
    """{layout: rank 0's step}, the layouts of each world size in one launch."""
    sys.path.insert(0, str(common.ROOT / "tests"))
    from dist import run_distributed
    out = {}
    for size in sorted({world_size(n) for n in names}):
        group = [n for n in names if world_size(n) == size]
        out.update(run_distributed(worker, size, group, env={"OMP_NUM_THREADS": "1"})[0])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    names = args.layouts.split(",")
    steps = _run(names)
    rows, extras = [], []
    for name in names:
        modeled, others = measured_by_kind(name, steps[name])
        want = analytic(name)
        for kind in sorted({k for k, _ in modeled} | {k for k, _ in want}):
            m = sum(s * c for (k, s), c in modeled.items() if k == kind)
            a = sum(s * c for (k, s), c in want.items() if k == kind)
            rows.append([name, kind, sum(c for (k, _), c in modeled.items() if k == kind),
                         sum(c for (k, _), c in want.items() if k == kind), m, a, f"{m / a:.2f}" if a else "-"])
        extras += [[name, op, size, count] for (op, size), count in sorted(others.items())]
    print("# one optimizer step, rank 0, tiny GPT (h 32, L 4, s 16, b 8, fp32), tp x pp x dp gloo ranks")
    print(format_table(["layout", "group:op", "count", "analytic count", "bytes", "analytic bytes",
                        "measured/analytic"], rows))
    print("\n# beyond the analytic list (logged name, bytes, count)")
    print(format_table(["layout", "logged op", "bytes", "count"], extras))
    return steps


if __name__ == "__main__":
    main()
