"""The auxiliary-loss-free balancing biases and the optimizer state through a resume at another layout, through the
universal checkpoint (``pipeline.checkpoints.universal``: the biases are in no optimizer state, which is all
DeepSpeed's loader restores):

* a run at EP1 (DP4, ZeRO-1; sigmoid routing with the biases moving 0.01 a step) saved at step 2 and resumed at EP2;
* DeepSeek-V3 whole (latent attention, one multi-token prediction depth, a dense first layer, 8 experts in 4 groups,
  a shared expert, the biases) run at (EP2, TP2) and saved at step 2, resumed at (EP1, TP1) and at EP4 (DP4).

Each resumed run continues as the uninterrupted one did: the same losses (steps 4 and 5 depend on the Adam moments
carried over), at the end the same biases and weights. One 4-rank launch and one 1-rank launch."""
import json

import torch
from dist import run_distributed
from test_checkpoint import losses
from test_deepseek_layouts import V3
from test_moe_job import MOE, _argv, _jobs, _save, moe, setup

from pipeline.checkpoints.checkpoint import read_full_model_state

__all__ = ["moe", "setup"]  # the fixtures of the MoE job tests

BIASED = {**MOE, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_router_bias_update_rate": 0.01}
# the job's sequences: 32 tokens; its vocabulary: the tokenizer's
DEEPSEEK = {**{k: v for k, v in V3.items() if k != "vocab_size"}, "max_position_embeddings": 32}
V3_RUN = "deepseek EP2 TP2"
V3_RESUMED = {"EP1 TP1": (), "EP4": ("--expert-parallel", "4")}
# measured 2026-12-05 (fp32): losses of steps 3-5 0.0 (EP1 -> EP2), 1.7e-8 ((EP2, TP2) -> (EP1, TP1) and -> EP4); the
# final weights 1.7e-7, 3.2e-7, 3.1e-7 (the largest max abs difference / max abs of a tensor)
TOLERANCE = 1e-6


def _biases(save, tag):
    _, full, _ = read_full_model_state(save, tag)
    return {name: value for name, value in full.items() if name.endswith("balance_bias")}


def _resumed(moe, run, name, *extra, model):
    load = ("--load", str(_save(moe, run)), "--load-tag", "global_step2")
    return _argv(moe, _save(moe, f"{run} resumed {name}"), *load, *extra, model=model)


def _rel(got: dict, want: dict) -> float:
    return max(abs(got[step] - want[step]) / want[step] for step in got)


def test_resumes_keep_the_biases_and_the_optimizer_state(moe):
    (moe / "biased.json").write_text(json.dumps(BIASED))
    (moe / "deepseek.json").write_text(json.dumps(DEEPSEEK))
    ep1 = _save(moe, "biased EP1")
    run_distributed(_jobs, 4, [
        _argv(moe, ep1, "--save-interval", "2", model="biased.json"),
        _resumed(moe, "biased EP1", "EP2", "--expert-parallel", "2", model="biased.json"),
        _argv(moe, _save(moe, V3_RUN), "--expert-parallel", "2", "--tensor-parallel", "2", "--save-interval", "2",
              model="deepseek.json"),
        _resumed(moe, V3_RUN, "EP4", *V3_RESUMED["EP4"], model="deepseek.json")])
    run_distributed(_jobs, 1, [_resumed(moe, V3_RUN, "EP1 TP1", model="deepseek.json")])
    cases = {("biased EP1", "EP2"): ep1, **{(V3_RUN, name): _save(moe, V3_RUN) for name in V3_RESUMED}}
    for (run, name), save in cases.items():
        resumed = _save(moe, f"{run} resumed {name}")
        saved = _biases(save, "global_step2")
        assert saved and any(b.abs().sum() > 0 for b in saved.values())  # they moved: a restart from zeros would show
        want, got = losses(save), losses(resumed)
        assert sorted(got) == [3, 4, 5]
        _, final, _ = read_full_model_state(save, "global_step5")
        _, final_resumed, _ = read_full_model_state(resumed, "global_step5")
        assert final.keys() == final_resumed.keys()
        weights = max(float((final_resumed[k] - v).abs().max() / v.abs().max()) for k, v in final.items()
                      if not k.endswith("balance_bias"))
        print(f"{run} resumed at {name}: losses of steps 3-5 {_rel(got, want):.1e}, final weights {weights:.1e} "
              f"relative to the uninterrupted run")
        assert _rel(got, want) < TOLERANCE and weights < TOLERANCE, (run, name)
        biases = {k: v for k, v in final.items() if k.endswith("balance_bias")}
        assert biases.keys() == saved.keys() and all(torch.equal(final_resumed[k], v) for k, v in biases.items())
    deepseek = _biases(_save(moe, V3_RUN), "global_step5")
    assert {k.split(".mlp.")[0] for k in deepseek} == {"layers.1", "layers.2", "mtp.layers.0.block"}
