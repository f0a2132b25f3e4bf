"""Expert parallelism (``--expert-parallel``, DeepSpeed-MoE) through the main job: a tiny llama MoE (4 experts,
top-2, dropless, fp32, dropout 0), 5 steps; per-step losses at (EP2, DP2) under ZeRO-1 and ZeRO-2 equal one
process; the refusals, one line each, before any work (resuming at another EP among them)."""
import json

import pytest
import torch.distributed as dist
from dist import run_distributed
from test_checkpoint import DS, _pretrain, args, losses
from test_sequence_parallel_job import LLAMA, _max_rel, _refusal_worker, setup

from pipeline.engine.distributed import init_distributed

MOE = {**LLAMA, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.1}
STEPS = 5
__all__ = ["setup"]  # the fixture of the sequence-parallel job tests


@pytest.fixture(scope="module")
def moe(setup):
    """The sequence-parallel job tests' corpus and DeepSpeed configs (ds.json: ZeRO-1), with MoE models."""
    (setup / "moe.json").write_text(json.dumps(MOE))
    (setup / "dense.json").write_text(json.dumps(LLAMA))
    (setup / "ds_z3.json").write_text(json.dumps({**DS, "zero_optimization": {"stage": 3}}))
    return setup


def _argv(setup, save, *extra, ds="ds.json", model="moe.json"):
    argv = args(setup, save, STEPS, "--micro-batch-size", "2", *extra, model=model)
    argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
    return argv


def _job(setup, save, world, *extra, ds="ds.json"):
    run_distributed(_pretrain, world, _argv(setup, save, *extra, ds=ds))
    return losses(save)


@pytest.fixture(scope="module")
def single(moe):
    return _job(moe, moe / "single", 1)


@pytest.mark.parametrize("ds", ["ds.json", "ds_z2.json"])
def test_expert_parallel_equals_single_process(moe, single, ds):
    """Each rank holds 2 of the 4 experts; ZeRO-1/2 partition them over the expert-data group (1 rank here)."""
    got = _job(moe, moe / f"ep2_{ds}", 2, "--expert-parallel", "2", ds=ds)
    rel = _max_rel(got, single)
    print(f"EP2 DP2 {ds}: max relative loss difference over {STEPS} steps {rel:.2e}")
    assert rel < 1e-5, (ds, got, single)
    assert len(set(single.values())) == STEPS  # it trained
    ours, theirs = _moe_records(moe / f"ep2_{ds}"), _moe_records(moe / "single")
    assert [r["moe_tokens_per_expert_1"] for r in ours] == [r["moe_tokens_per_expert_1"] for r in theirs]
    for r in ours:  # global batch 4 x 32 tokens, 2 routes each, per MoE layer (both layers)
        counts = r["moe_tokens_per_expert_0"]
        assert sum(counts) == 4 * 32 * 2 and r["moe_load_ratio_0"] == max(counts) / (sum(counts) / 4)
        assert r["moe_dropped_fraction_0"] == 0.0 and r["moe_aux_loss"] > 0.1 * 2 * 0.9  # coeff x ~1 per layer


def _moe_records(save):
    return [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "moe_aux_loss" in r]


def _refusals(rank, argvs):
    out = []
    for argv in argvs:
        out.append(_refusal_worker(rank, argv))
        if not dist.is_initialized():
            init_distributed("gloo")
    return out


def test_refusals_before_any_work(moe, tmp_path):
    cases = [(("--expert-parallel", "2"), "ds.json", "moe.json",
              "--expert-parallel 2 does not divide the data-parallel size 1"),
             (("--expert-parallel", "3"), "ds.json", "moe.json", "--expert-parallel 3 does not divide num_experts 4"),
             ((), "ds_z3.json", "moe.json", "zero_optimization.stage 3 with MoE layers"),
             (("--expert-parallel", "2"), "ds.json", "dense.json", "the model has no experts")]
    if (moe / "ep2_ds.json").is_dir():  # saved at EP2 by the test above: experts are not resharded yet
        cases.append((("--load", str(moe / "ep2_ds.json")), "ds.json", "moe.json",
                      "the run was saved at --expert-parallel 2, this job runs at 1"))
    argvs = [_argv(moe, tmp_path / f"run{i}", *extra, ds=ds, model=model)
             for i, (extra, ds, model, _) in enumerate(cases)]
    for i, ((code, err), (*_, message)) in enumerate(zip(run_distributed(_refusals, 1, argvs)[0], cases)):
        line = err.strip().splitlines()[-1]
        assert code == 2 and line.startswith("error: ") and message in line, err
        assert err.count("error: ") == 1 and "Traceback" not in err, err
        assert not (tmp_path / f"run{i}").exists() or [p.name for p in (tmp_path / f"run{i}").iterdir()] == [".run.lock"]
