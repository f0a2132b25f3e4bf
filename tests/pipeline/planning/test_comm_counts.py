"""Every collective of one optimizer step counted by DeepSpeed's comms logger (the project's own go through
deepspeed.comm as ``tp/...``) against the planner's analytic list, with bench/comm_volume.py's method (the log
after the second step less the log after the first): TP 2 and TP 2 + SP equal it call for call (count and bytes
of each message), PP 2 and DP 2 at ZeRO 1 and 3 in bytes per group and operation (DeepSpeed splits its buckets
by parameter group). gloo CPU ranks, the tiny fp32 GPT, one micro-batch. The combined layouts (four ranks) are
the bench's only: one four-rank launch costs more than these five layouts together."""
import sys
from collections import Counter

from conftest import ROOT
from dist import run_distributed

sys.path.insert(0, str(ROOT / "bench"))
import comm_volume  # noqa: E402

LAYOUTS = ["tp2", "tp2-sp", "pp2", "dp2-z1", "dp2-z3"]


def _bytes(counts: Counter) -> Counter:
    out = Counter()
    for (kind, size), count in counts.items():
        out[kind] += size * count
    return out


def test_collectives_equal_the_analytic_formulas():
    ranks = run_distributed(comm_volume.worker, 2, LAYOUTS, env={"OMP_NUM_THREADS": "1"})
    for name in LAYOUTS:
        modeled, _ = comm_volume.measured_by_kind(name, ranks[0][name])
        want = comm_volume.analytic(name)
        assert want, name
        if name.startswith("tp"):
            assert modeled == want, (name, sorted(modeled.items()), sorted(want.items()))
        else:
            assert _bytes(modeled) == _bytes(want), (name, sorted(modeled.items()), sorted(want.items()))
