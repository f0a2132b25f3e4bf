"""Every collective of one optimizer step counted by DeepSpeed's comms logger (the project's own go through
deepspeed.comm as ``tp/...``) against the planner's analytic list, with bench/comm_volume.py's method (the log
after the second step less the log after the first), on four gloo CPU ranks in combined layouts that hold the
single ones: TP 2 x DP 2 at ZeRO 1, TP 2 + SP x DP 2 at ZeRO 3, PP 2 x DP 2 at ZeRO 1. The TP collectives equal
the list call for call (count and bytes of each message); PP and DP in bytes per group and operation (DeepSpeed
splits its buckets by parameter group). The tiny fp32 GPT, one micro-batch; rank 0 (the first stage)."""
import sys
from collections import Counter

from conftest import ROOT
from dist import run_distributed

sys.path.insert(0, str(ROOT / "bench"))
import comm_volume  # noqa: E402

LAYOUTS = ["tp2-dp2-z1", "tp2-sp-dp2-z3", "pp2-dp2-z1"]


def _bytes(counts: Counter) -> Counter:
    out = Counter()
    for (kind, size), count in counts.items():
        out[kind] += size * count
    return out


def _tp(counts: Counter) -> Counter:
    return Counter({k: v for k, v in counts.items() if k[0].startswith("tp:")})


def test_collectives_equal_the_analytic_formulas():
    ranks = run_distributed(comm_volume.worker, 4, LAYOUTS, env={"OMP_NUM_THREADS": "1"})
    for name in LAYOUTS:
        modeled, _ = comm_volume.measured_by_kind(name, ranks[0][name])
        want = comm_volume.analytic(name)
        assert {k for k, _ in want} >= {"dp:all_gather"}, name
        assert _tp(modeled) == _tp(want), (name, sorted(modeled.items()), sorted(want.items()))
        assert _bytes(modeled) == _bytes(want), (name, sorted(modeled.items()), sorted(want.items()))
