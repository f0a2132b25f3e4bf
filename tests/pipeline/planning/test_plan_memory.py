"""The planner's model-state memory against a tensor census of the real engine at ZeRO 0-3 (DP 2, gloo CPU
ranks, bf16 + AdamW): the method and worker of bench/zero_memory.py, DeepSpeed's buckets at 1% of the model."""
import sys

from conftest import ROOT
from dist import run_distributed

STAGES = (0, 1, 2, 3)


def _census(rank):
    sys.path.insert(0, str(ROOT / "bench"))
    import zero_memory
    config = zero_memory.common.model_config(zero_memory.CPU_SIZES["small"], "gpt2")
    bucket = max(10_000, config.num_parameters() // 100)
    return {stage: zero_memory.worker(rank, "gpt2", "small", stage, bucket, 3, 16) for stage in STAGES}


def test_model_states_match_the_census_within_5_percent():
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    from pipeline.planning.memory import model_states
    from pipeline.families.gpt.shape import gpt_shape
    shape = gpt_shape(common.model_config(common.CPU_SIZES["small"], "gpt2"))
    results = run_distributed(_census, 2, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    for stage in STAGES:
        measured = max(r[stage]["states"] for r in results)
        assert results[0][stage]["padded_params"] == shape.params
        predicted = model_states(shape.params, stage, 2, "bf16").total
        assert abs(measured / predicted - 1) < 0.05, (stage, measured, predicted)
