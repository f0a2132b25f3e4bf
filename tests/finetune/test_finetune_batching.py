"""Training batches grouped by length: little padding, the same epoch coverage as random batches, the same
examples per optimizer step at every layout, an order that is a function of (seed, epoch); and the
micro-batch chosen from the data; a position restored from its state."""
import numpy as np
import pytest

from finetune.batching import TrainBatches, auto_micro_batch

RNG = np.random.default_rng(0)
ENCODED = [[1000 + i] + [7] * int(n) for i, n in enumerate(RNG.integers(0, 60, size=203))]  # first token: which text
LABELS = RNG.integers(0, 2, size=(len(ENCODED), 3))


def step_examples(micro: int, dp: int, global_batch: int, group: int, steps: int) -> list[list[int]]:
    """Per optimizer step, the sorted example indices all DP ranks take over the step's micro-batches."""
    ranks = [TrainBatches(ENCODED, LABELS, micro, r, dp, 0, seed=5, group_by_length=group,
                          global_batch_size=global_batch) for r in range(dp)]
    out = []
    for _ in range(steps):
        taken = [int(i) - 1000 for _ in range(global_batch // (micro * dp)) for b in ranks
                 for i in next(b)["input_ids"][:, 0]]
        out.append(sorted(taken))
    return out


def test_grouped_batches_are_padded_little_and_cover_the_epoch_once():
    n_steps = len(ENCODED) // 16
    random = TrainBatches(ENCODED, LABELS, 16, 0, 1, 0, seed=5, global_batch_size=16)
    grouped = TrainBatches(ENCODED, LABELS, 16, 0, 1, 0, seed=5, group_by_length=6, global_batch_size=16)
    pad = {}
    for name, b in (("random", random), ("grouped", grouped)):
        batches = [next(b) for _ in range(n_steps)]
        real = sum(int(x["lengths"].sum()) for x in batches)
        pad[name] = 1 - real / sum(x["input_ids"].numel() for x in batches)
    assert pad["grouped"] < pad["random"] / 3, pad
    order = grouped.epoch_order(0)
    assert len(order) == n_steps * 16 and len(set(order.tolist())) == len(order)  # each example at most once
    assert not np.array_equal(order, grouped.epoch_order(1))  # another epoch, another order
    assert sorted(order) == sorted(random.epoch_order(0))  # the same examples as random batches
    assert np.array_equal(order, TrainBatches(ENCODED, LABELS, 16, 0, 1, 0, seed=5, group_by_length=6,
                                              global_batch_size=16).epoch_order(0))  # a function of (seed, epoch)


@pytest.mark.parametrize("group", [0, 3])
def test_a_step_takes_the_same_examples_at_every_layout(group):
    # one process accumulating 4 micro-batches of 4, 2 DP ranks x 2 of 4, 4 DP ranks x 1 of 4, 1 x 16
    layouts = [(4, 1), (4, 2), (4, 4), (16, 1)]
    steps = [step_examples(micro, dp, 16, group, 15) for micro, dp in layouts]
    for other in steps[1:]:
        assert other == steps[0]


def test_the_tail_of_each_epoch_is_left_out_and_the_next_epoch_starts_fresh():
    b = TrainBatches(ENCODED, LABELS, 8, 0, 1, 0, seed=1, group_by_length=2, global_batch_size=16)
    per_epoch = len(ENCODED) // 16 * 2  # micro-batches of 8 per epoch
    for _ in range(per_epoch):
        next(b)
    assert b.epoch == 0
    next(b)
    assert b.epoch == 1 and b.consumed == 8


@pytest.mark.parametrize("stop", [5, 12, 13])  # 12 global micro-batches an epoch: inside one, at its end, after
def test_batches_restored_from_their_state_continue_as_if_uninterrupted(stop):
    def batches(seed=3):
        return TrainBatches(ENCODED, LABELS, 8, 1, 2, 0, seed=seed, group_by_length=2, global_batch_size=16)
    straight, first = batches(), batches()
    want = [next(straight)["input_ids"] for _ in range(stop + 30)]
    for _ in range(stop):
        next(first)
    resumed = batches()
    resumed.load_state_dict(first.state_dict())
    got = want[:stop] + [next(resumed)["input_ids"] for _ in range(30)]
    assert all(a.equal(b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="at seed 3, these batches hold 203 at seed 4"):
        batches(seed=4).load_state_dict(first.state_dict())

def test_auto_micro_batch_is_the_largest_divisor_that_fits():
    assert auto_micro_batch(16, 1e6, 1e9) == 16
    assert auto_micro_batch(16, 1e6, 5e6) == 4     # 8 would need 8e6
    assert auto_micro_batch(12, 1e6, 5.5e6) == 4   # divisors of 12: 6 does not fit, 4 does
    assert auto_micro_batch(16, 1e9, 1e6) == 1     # nothing fits: one sequence at a time
    with pytest.raises(ValueError):
        auto_micro_batch(0, 1.0, 1.0)
