"""The LR schedule's decay factor (what the balancing bias's "lr" rate schedule multiplies by) against the
schedule's own learning rates: 1 through warmup, then where the LR is between its minimum and its peak."""
import math

import pytest

from pipeline.engine.schedules import LRSchedule


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_decay_factor_places_the_lr_between_its_minimum_and_its_peak(style):
    schedule = LRSchedule(lr=3e-3, warmup_steps=4, total_steps=20, style=style, min_lr=3e-4)
    factors = [schedule.decay_factor(step) for step in range(20)]
    assert factors[:5] == [1.0] * 5  # warmup, and the peak at its end
    for step in range(4, 20):
        assert math.isclose(schedule(step), 3e-4 + (3e-3 - 3e-4) * factors[step], rel_tol=1e-12)
    if style == "constant":
        assert factors == [1.0] * 20 and schedule(19) == 3e-3
    else:  # falling to 0 where the LR reaches its minimum
        assert all(a > b for a, b in zip(factors[4:], factors[5:])) and factors[-1] < 0.1
        assert math.isclose(schedule.decay_factor(20), 0.0, abs_tol=1e-15)
