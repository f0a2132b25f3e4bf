"""Every TP collective of one optimizer step counted by DeepSpeed's comms logger (the project's collectives go
through deepspeed.comm, named ``tp/...``) equals the planner's analytic list exactly, in count and bytes:
TP 2 and TP 2 + SP, gloo CPU ranks, fp32, one micro-batch."""
from collections import Counter

from dist import run_distributed
from engine_utils import BASE_DS, SEQ, TINY

from models import GPTConfig

OPS = {"tp/all_reduce": "all_reduce", "tp/all_gather_into_tensor": "all_gather", "tp/all_gather": "all_gather",
       "tp/reduce_scatter_tensor": "reduce_scatter"}


def _logged(rank):
    import deepspeed.comm as dc
    from engine_utils import train_worker
    out = {}
    for sp in (False, True):
        dc.reset_log()
        train_worker(rank, tp=2, ds_overrides={"comms_logger": {"enabled": True, "prof_all": True}},
                     model_overrides={"sequence_parallel": sp}, steps=1)
        out[sp] = {name: {size: v[0] for size, v in d.items()} for name, d in dc.comms_logger.comms_dict.items()}
    return out


def _analytic(sp: bool) -> Counter:
    from pipeline.planning.hardware import hardware
    from pipeline.planning.layouts import Job, Layout, step_collectives
    from pipeline.planning.shapes import gpt_shape
    shape = gpt_shape(GPTConfig(**TINY), "tiny")
    job = Job(shape, hardware("h100-dgx"), gpus=2, global_batch=BASE_DS["train_batch_size"], precision="fp32")
    counts = Counter()
    for c in step_collectives(job, Layout(2, 1, 1, 0, sp, "none", BASE_DS["train_batch_size"])):
        logged = c.bytes / 2 if c.op == "all_gather" else c.bytes
        counts[(c.op, int(logged))] += c.count
    return counts


def test_tp_collectives_equal_the_analytic_formulas():
    logged = run_distributed(_logged, 2)
    assert SEQ == TINY["max_position_embeddings"]
    for rank in logged:
        for sp in (False, True):
            measured = Counter()
            for name, sizes in rank[sp].items():
                if name in OPS:
                    for size, count in sizes.items():
                        measured[(OPS[name], size)] += count
            assert measured == _analytic(sp), (sp, sorted(measured.items()), sorted(_analytic(sp).items()))
