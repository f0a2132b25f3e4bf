"""Expert parallelism (``--expert-parallel``, DeepSpeed-MoE) through the main job: a tiny llama MoE (4 experts,
top-2, dropless, fp32, dropout 0), 5 steps of 8 sequences; per-step losses at (EP2, DP4) under ZeRO-1 and ZeRO-2,
at (EP2, TP2) and at (EP2, PP2) equal one process, and with a capacity factor the same tokens are dropped at
EP1 and EP2 (DP4, TP2); the run saved at (EP2, TP2) resumes at (EP1, TP1) and at EP4 (DP4) with its optimizer
state, continuing as it did, and so does the same run in bf16 and fp16 at (EP1, TP1); the refusals, one line each, before
any work. Two launches: every 4-rank layout and
the EP4 resume, then the one-process references, the EP1 resume and the refusals, one after the other in the
same processes (``_jobs``)."""
import json

import pytest
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from dist import run_distributed
from test_checkpoint import DS, _pretrain, args, losses
from test_sequence_parallel_job import LLAMA, _max_rel, _refusal_worker, setup

from models.moe import EXPERT_INDEX
from pipeline.checkpoints.checkpoint import read_full_model_state
from pipeline.engine.distributed import init_distributed

MOE = {**LLAMA, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.1}
STEPS = 5
BATCH = 8  # micro-batches of 2: four at one process, two per rank at DP2, one at DP4 (the same micro-batches)
EP2 = ("--expert-parallel", "2")
# capacity max(4, ceil(2 x 64 routes / 4 experts x 0.7)) = 23 slots a micro-batch: about a third of the routes
# dropped, and an odd capacity that TP2 rounds its buffer up from
CAPACITY = {**MOE, "moe_capacity_factor": 0.7}
LAYOUTS = {  # name: (extra arguments, DeepSpeed config, model config); 4 ranks each
    "EP2 DP4": (EP2, "ds.json", "moe.json"),  # expert-data groups of 2 ranks: ZeRO partitions the experts over them
    "EP2 DP4 ZeRO-2": (EP2, "ds_z2.json", "moe.json"),
    "EP2 TP2": ((*EP2, "--tensor-parallel", "2", "--save-interval", "2"), "ds.json", "moe.json"),  # resumed below
    "EP2 PP2": ((*EP2, "--pipeline-parallel", "2"), "ds.json", "moe.json"),  # a layer per stage
    "EP2 DP4 capacity": (EP2, "ds.json", "capacity.json"),
    "EP2 TP2 capacity": ((*EP2, "--tensor-parallel", "2"), "ds.json", "capacity.json"),
}
REFERENCES = {"moe.json": "single", "capacity.json": "single capacity"}  # one process, EP 1
RESUMED = {"EP4 DP4": ("--expert-parallel", "4"), "EP1 TP1": ()}  # from (EP2, TP2) at step 2: 4 ranks, 1 rank
# (EP2, TP2) in DeepSpeed's bf16 and fp16 at ZeRO-1, saved at step 2 and resumed at (EP1, TP1): precision -> config
HALF = {"bf16": {"bf16": {"enabled": True}},
        "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}}
__all__ = ["setup"]  # the fixture of the sequence-parallel job tests


@pytest.fixture(scope="module")
def moe(setup, tmp_path_factory):
    """The sequence-parallel job tests' corpus, with MoE models and DeepSpeed configs of 8 sequences a step."""
    d = tmp_path_factory.mktemp("moe")
    (d / "corpus.txt").symlink_to(setup / "corpus.txt")
    (d / "moe.json").write_text(json.dumps(MOE))
    (d / "capacity.json").write_text(json.dumps(CAPACITY))
    (d / "dense.json").write_text(json.dumps(LLAMA))
    for name, stage in (("ds.json", 1), ("ds_z2.json", 2), ("ds_z3.json", 3), ("ds_z0.json", 0)):
        (d / name).write_text(json.dumps({**DS, "train_batch_size": BATCH, "zero_optimization": {"stage": stage}}))
    for precision, extra in HALF.items():
        (d / f"ds_{precision}.json").write_text(json.dumps({**DS, "train_batch_size": BATCH, **extra}))
    return d


def _argv(setup, save, *extra, ds="ds.json", model="moe.json"):
    argv = args(setup, save, STEPS, "--micro-batch-size", "2", *extra, model=model)
    argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
    return argv


def _save(moe, name):
    return moe / name.replace(" ", "_")


def _jobs(rank, argvs, refusals=()):
    get_accelerator().is_fp16_supported = lambda: True  # the CPU accelerator refuses fp16; its loss scaling is real
    for argv in argvs:
        _pretrain(rank, argv)
    out = []
    for argv in refusals:
        out.append(_refusal_worker(rank, argv))
        if not dist.is_initialized():
            init_distributed("gloo")
    return out


def _refusal_cases(moe):
    return [(("--expert-parallel", "2"), "ds.json", "moe.json",
             "--expert-parallel 2: does not divide data x context parallel 1"),
            (("--expert-parallel", "3"), "ds.json", "moe.json", "--expert-parallel 3: does not divide num_experts 4"),
            ((), "ds_z3.json", "moe.json", "zero_optimization.stage 3 with MoE layers"),
            (("--expert-parallel", "2"), "ds.json", "dense.json", "with a dense model (num_experts 0): nothing to split"),
            (("--load", str(_save(moe, "EP2 TP2"))), "ds_z0.json", "moe.json",  # convert_moe reads ZeRO-1/2 only
             "optimizer state moves between ZeRO-1/2 layouts only")]


def _resume(moe, name, run="EP2 TP2", ds="ds.json"):
    """The ``run``'s step-2 checkpoint continued to step 5 at layout ``name``."""
    load = ("--load", str(_save(moe, run)), "--load-tag", "global_step2")
    return _argv(moe, _save(moe, f"resumed {name}" + run.removeprefix("EP2 TP2")), *load, *RESUMED[name], ds=ds)


@pytest.fixture(scope="module")
def runs(moe):
    """The losses of every layout and of one process, and the refusals' (exit code, stderr): two launches."""
    run_distributed(_jobs, 4, [*(_argv(moe, _save(moe, name), *extra, ds=ds, model=model)
                                 for name, (extra, ds, model) in LAYOUTS.items()), _resume(moe, "EP4 DP4"),
                               *(_argv(moe, _save(moe, f"EP2 TP2 {p}"), *LAYOUTS["EP2 TP2"][0], ds=f"ds_{p}.json")
                                 for p in HALF)])
    refusals = [_argv(moe, moe / f"refused{i}", *extra, ds=ds, model=model)
                for i, (extra, ds, model, _) in enumerate(_refusal_cases(moe))]
    out = run_distributed(_jobs, 1, [*(_argv(moe, _save(moe, name), model=model) for model, name in REFERENCES.items()),
                                     _resume(moe, "EP1 TP1"),
                                     *(_resume(moe, "EP1 TP1", f"EP2 TP2 {p}", f"ds_{p}.json") for p in HALF)],
                           refusals)[0]
    names = (*REFERENCES.values(), *LAYOUTS, *(f"resumed {name}" for name in RESUMED),
             *(f"{run} {p}" for p in HALF for run in ("EP2 TP2", "resumed EP1 TP1")))
    return {"refusals": out, **{name: losses(_save(moe, name)) for name in names}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_equals_single_process(moe, runs, layout):
    """Each rank holds 2 of the 4 experts; ZeRO-1/2 partition them over the expert-data group; at TP2 each
    expert's columns are split over the TP ranks as the dense MLP's. With a capacity: the same tokens dropped."""
    reference = REFERENCES[LAYOUTS[layout][2]]
    got, single = runs[layout], runs[reference]
    rel = _max_rel(got, single)
    print(f"{layout}: max relative loss difference over {STEPS} steps {rel:.2e}")
    assert rel < 1e-6, (layout, got, single)  # (the composition matrix measures <= 1.4e-7 at these layouts)
    assert len(set(single.values())) == STEPS  # it trained
    ours, theirs = _moe_records(_save(moe, layout)), _moe_records(_save(moe, reference))
    for key in ("moe_tokens_per_expert_1", "moe_dropped_fraction_0", "moe_dropped_fraction_1"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    for r in ours:  # global batch 8 x 32 tokens, 2 routes each, per MoE layer (both layers)
        counts = r["moe_tokens_per_expert_0"]
        assert sum(counts) == BATCH * 32 * 2 and r["moe_load_ratio_0"] == max(counts) / (sum(counts) / 4)
        assert r["moe_aux_loss"] > 0.1 * 2 * 0.9  # coeff x ~1 per layer
        dropped = r["moe_dropped_fraction_0"] + r["moe_dropped_fraction_1"]
        assert dropped > 0.0 if "capacity" in layout else dropped == 0.0, r


@pytest.mark.parametrize("layout", RESUMED)
def test_resume_at_another_expert_parallel_size_continues_the_run(runs, layout):
    """(EP2, TP2) saved at step 2 (DeepSpeed's universal path cannot take DeepSpeed-MoE's expert groups:
    ``universal.convert_moe`` joins each expert's weight and Adam moments by its global index) continues at
    (EP1, TP1) and at EP4 (DP4) as the uninterrupted run did: steps 4 and 5 depend on the moments carried over."""
    got, want = runs[f"resumed {layout}"], runs["EP2 TP2"]
    assert sorted(got) == [3, 4, 5], got
    rel = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    print(f"(EP2, TP2) -> {layout}: max relative loss difference over steps 3-5 {rel:.2e}")
    assert rel < 1e-5, (layout, got, want)


@pytest.mark.parametrize("precision", HALF)
def test_half_precision_run_resumes_at_another_layout_with_its_optimizer_state(moe, runs, precision):
    """bf16 / fp16 at ZeRO-1 (a bf16 run's files carry a ``bf16_`` prefix; fp16 adds the loss scaler's state): the
    (EP2, TP2) run saved at step 2 continues at (EP1, TP1). Its universal cache holds every expert's fp32 master
    weight under its global index, each rounding to the half precision exactly as the weight the run saved (a
    misplaced expert or TP shard would not), with Adam moments; steps 3-5 follow the uninterrupted run within
    the half precision's rounding at another layout."""
    run = _save(moe, f"EP2 TP2 {precision}")
    _, saved, _ = read_full_model_state(run, "global_step2")
    # (converted into the resumed run's --save, never into the run it reads)
    cache = _save(moe, f"resumed EP1 TP1 {precision}") / "universal" / "global_step2" / "zero"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    experts = [name for name in saved if EXPERT_INDEX.search(name)]
    assert len(experts) == 2 * 4 * 2  # 2 MoE layers x 4 experts x (fc_in, fc_out)
    for name in saved:
        master = torch.load(cache / name / "fp32.pt", weights_only=True)["param"]
        assert saved[name].dtype == dtype and torch.equal(master.to(dtype), saved[name]), name
        assert torch.load(cache / name / "exp_avg_sq.pt", weights_only=True)["param"].abs().sum() > 0, name
    got, want = runs[f"resumed EP1 TP1 {precision}"], runs[f"EP2 TP2 {precision}"]
    assert sorted(got) == [3, 4, 5], got
    rel = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    print(f"{precision} (EP2, TP2) -> (EP1, TP1): max relative loss difference over steps 3-5 {rel:.2e}")
    assert rel < 1e-3, (got, want)  # 1.1e-5 (bf16), 5.1e-7 (fp16) measured: master weights and moments carried over
    if precision == "fp16":  # the dynamic loss scale carries on (it doubled from 256 by step 3; a new scaler is 256)
        scales = [[r["loss_scale"] for r in map(json.loads, (_save(moe, name) / "metrics.jsonl").read_text()
                                               .splitlines()) if r.get("step", 0) >= 3 and "loss_scale" in r]
                  for name in (f"resumed EP1 TP1 {precision}", f"EP2 TP2 {precision}")]
        assert scales[0] == scales[1] and scales[0][0] > 256, scales


def _moe_records(save):
    return [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "moe_aux_loss" in r]


def test_refusals_before_any_work(moe, runs):
    for i, ((code, err), (*_, message)) in enumerate(zip(runs["refusals"], _refusal_cases(moe))):
        line = err.strip().splitlines()[-1]
        assert code == 2 and line.startswith("error: ") and message in line, err
        assert err.count("error: ") == 1 and "Traceback" not in err, err
        run = moe / f"refused{i}"
        assert not run.exists() or [p.name for p in run.iterdir()] == [".run.lock"]
