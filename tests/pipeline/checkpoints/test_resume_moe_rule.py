"""A run with MoE layers resumed at another layout goes through the one layout validator (pipeline.job.layout):
its rule refuses a pipeline or a ZeRO stage other than 1/2 on either side; tests/pipeline/training/test_moe_job.py
runs the refusal end to end (a ZeRO-0 resume of an EP2 TP2 run)."""
import pytest

from models.parallel import Layout
from pipeline.checkpoints.universal import saved_layout_of
from pipeline.job.layout import MOE_RUN_RESUMED_FROM, LayoutCheck, LayoutError, refusal, validate

SAVED = Layout(tensor=2, data=2, expert=2, zero_stage=1)


def check(current: Layout, saved: Layout | None) -> LayoutCheck:
    return LayoutCheck(current, source="--load run (global_step2)",
                       extras={} if saved is None else {MOE_RUN_RESUMED_FROM: saved})


@pytest.mark.parametrize("current, saved, reason", [
    (Layout(data=4, zero_stage=0), SAVED, "an MoE run's optimizer state moves between ZeRO-1/2 layouts only"),
    (Layout(data=4, zero_stage=2), SAVED.replace(pipeline=2, data=1),
     "an MoE run moves to another layout without pipeline parallelism only"),
    (Layout(pipeline=2, data=2, zero_stage=1), SAVED, "an MoE run moves to another layout without pipeline"),
])
def test_a_moe_run_that_cannot_move_is_refused_by_the_validator(current, saved, reason):
    with pytest.raises(LayoutError, match=f"^--load run \\(global_step2\\): {reason}.*resume it at the layout it was "
                                          f"saved at \\(TP 2"):
        validate(check(current, saved))


def test_a_moe_run_moves_between_zero_1_and_2_and_a_fresh_start_is_not_asked():
    assert refusal(check(Layout(data=4, zero_stage=2), SAVED)) is None
    assert refusal(check(Layout(data=4, zero_stage=0), None)) is None  # no resumed MoE run: the rule is silent


def test_a_record_without_its_zero_stage_reads_as_zero_1():
    assert saved_layout_of({"tensor_parallel": 2, "data_parallel": 2}) == Layout(tensor=2, data=2, zero_stage=1)
    assert saved_layout_of(SAVED.record()) == SAVED
