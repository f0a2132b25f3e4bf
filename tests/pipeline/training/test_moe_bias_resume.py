"""The auxiliary-loss-free balancing biases through a resume at another layout: a run at EP1 (DP2, ZeRO-1; sigmoid
routing with the biases moving 0.01 a step) saved at step 2 and resumed at EP2 through the universal checkpoint
(``pipeline.checkpoints.universal``: the biases are in no optimizer state, which is all DeepSpeed's loader
restores) continues as the run did: the same losses and, at the end, the same biases. One 2-rank launch."""
import json

import torch
from dist import run_distributed
from test_checkpoint import losses
from test_moe_job import MOE, _argv, _jobs, _save, moe, setup

from pipeline.checkpoints.checkpoint import read_full_model_state

__all__ = ["moe", "setup"]  # the fixtures of the MoE job tests

BIASED = {**MOE, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_router_bias_update_rate": 0.01}


def _biases(save, tag):
    _, full, _ = read_full_model_state(save, tag)
    return {name: value for name, value in full.items() if name.endswith("balance_bias")}


def test_resume_at_ep2_keeps_the_biases_of_an_ep1_run(moe):
    (moe / "biased.json").write_text(json.dumps(BIASED))
    run, resumed = _save(moe, "biased EP1"), _save(moe, "biased resumed EP2")
    load = ("--load", str(run), "--load-tag", "global_step2", "--expert-parallel", "2")
    run_distributed(_jobs, 2, [_argv(moe, run, "--save-interval", "2", model="biased.json"),
                               _argv(moe, resumed, *load, model="biased.json")])
    saved = _biases(run, "global_step2")
    assert saved and all(b.abs().sum() > 0 for b in saved.values())  # they moved: a restart from zeros would show
    want, got = losses(run), losses(resumed)
    diffs = {step: abs(got[step] - want[step]) / want[step] for step in got}
    print("resumed at EP2 vs the EP1 run, relative loss differences:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert sorted(got) == [3, 4, 5] and max(diffs.values()) < 1e-6  # measured 2026-12-05: 0.0 (without the restore: 2e-4)
    final, final_resumed = _biases(run, "global_step5"), _biases(resumed, "global_step5")
    assert final.keys() == saved.keys() and all(torch.equal(final_resumed[k], final[k]) for k in final)
