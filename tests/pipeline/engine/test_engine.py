"""The DeepSpeed engine at every layout gives the single-process losses (fp32, dropout 0, same global batch)."""
import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from dist import run_distributed
from engine_utils import BASE_DS, TINY, GlobalBatchLoader, real_text_tokens, train_worker
from models import GPTConfig
from models.parallel import initialize_model_parallel, model_parallel_seed
from models.recompute import DiscardedOutput
from models.parallel import Layout
from pipeline.job.layout import LayoutCheck, LayoutError, validate
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import EngineConfigError, precision, resolve_ds_config, zero_stage
from pipeline.engine.schedules import LRSchedule
from pipeline.engine.steps import lm_batches, train_step

Z1 = {"zero_optimization": {"stage": 1}}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(train_worker, 1)[0]["loss"]


def _assert_same(losses, reference, label):
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    print(f"{label}: max relative loss difference over {len(diffs)} steps {max(diffs):.2e}")
    assert len(losses) == len(reference) >= 5
    assert max(diffs) < 1e-6, (label, losses, reference)  # the composition matrix measures <= 1.4e-7 (fp32)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_zero_stages(stage, reference):
    results = run_distributed(train_worker, 2, 1, 1, {"zero_optimization": {"stage": stage}})
    for r in results:
        _assert_same(r["loss"], reference, f"DP=2 ZeRO-{stage}")


def test_pipeline_parallel_tied_with_accumulation(reference):
    # micro batch 2 of a global batch 8: 4 accumulation steps through 2 stages sharing the embedding
    for r in run_distributed(train_worker, 2, 1, 2, Z1, None, 5, 2):
        _assert_same(r["loss"], reference, "PP=2")


def test_tensor_and_pipeline_parallel(reference):
    for r in run_distributed(train_worker, 4, 2, 2, Z1, None, 5, 2):
        _assert_same(r["loss"], reference, "TP=2 x PP=2")


def test_pipeline_untied_llama():
    model = {"variant": "llama", "tie_embeddings": False, "num_kv_heads": 2}
    ref = run_distributed(train_worker, 1, 1, 1, None, model)[0]["loss"]
    for r in run_distributed(train_worker, 2, 1, 2, Z1, model, 5, 2):
        _assert_same(r["loss"], ref, "llama PP=2")


ALL_MODULES = ("core_attn", "mlp_act", "layernorm")


def _recompute_policies_worker(rank):
    """Every policy, with dropout 0.1 and 0, and all modules under sequence parallelism, one after the other in
    this one TP2 launch (each from the same seeds)."""
    out = {}
    for dropout in (0.1, 0.0):
        drop = {"hidden_dropout": dropout, "attention_dropout": dropout}
        for label, policy, modules in (("none", "none", ()), ("selective", "selective", ("core_attn",)),
                                       ("selective all", "selective", ALL_MODULES), ("full", "full", ())):
            out[dropout, label] = train_worker(rank, 2, 1, None, drop, recompute=policy,
                                               recompute_modules=modules)["loss"]
    sp = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "sequence_parallel": True}
    for label, policy in (("none", "none"), ("selective all", "selective")):
        out["sp", label] = train_worker(rank, 2, 1, None, sp, recompute=policy, recompute_modules=ALL_MODULES)["loss"]
    # the whole MLP (Megatron-Core's mlp: its TP all-reduce runs again), and the experts' activation (moe_act)
    out["mlp"] = train_worker(rank, 2, 1, None, {"hidden_dropout": 0.1, "attention_dropout": 0.1},
                              recompute="selective", recompute_modules=("core_attn", "mlp", "layernorm"))["loss"]
    moe = {"variant": "llama", "num_kv_heads": 2, "num_experts": 4, "moe_top_k": 2}
    for label, policy in (("none", "none"), ("moe_act", "selective")):
        out["moe", label] = train_worker(rank, 2, 1, Z1, moe, recompute=policy, recompute_modules=("moe_act",))["loss"]
    return out


def test_recomputation_policies_are_exact_at_tp2(reference):
    # dropout in TP regions, in the attention and on the residual: recomputation must redraw the very same masks;
    # the norms and MLP activations (mlp_act, layernorm) draw none but are rebuilt from their kept inputs
    r = run_distributed(_recompute_policies_worker, 2)[0]
    for dropout in (0.1, 0.0):
        for label in ("selective", "selective all", "full"):
            assert r[dropout, label] == r[dropout, "none"], (dropout, label, r)
    assert r["sp", "selective all"] == r["sp", "none"], r  # sequence parallelism: the norms on sequence chunks
    assert r["mlp"] == r[0.1, "none"], r
    assert r["moe", "moe_act"] == r["moe", "none"], r
    _assert_same(r[0.0, "none"], reference, "TP=2 (every policy, bit for bit)")


def test_bf16_trains():
    r = run_distributed(train_worker, 1, 1, 1, {"bf16": {"enabled": True}}, None, 8)[0]
    assert r["loss"][-1] < r["loss"][0] - 0.2, r["loss"]


def test_fp16_dynamic_loss_scale_skips_overflow_steps():
    # An initial scale of 2^20 overflows fp16 gradients: the step is skipped, the scale halves,
    # the learning-rate schedule does not advance, and training then goes on.
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "loss_scale_window": 1000,
                     "hysteresis": 1, "min_loss_scale": 1}, **Z1}
    r = run_distributed(train_worker, 1, 1, 1, fp16, None, 10, None, "none", True)[0]
    print("fp16 scales", r["scale"], "skipped", r["skipped"], "loss", r["loss"])
    assert r["skipped"][0] == 1 and r["scale"][0] == 2.0**19
    assert all(b <= a for a, b in zip(r["scale"], r["scale"][1:]))
    assert r["skipped"][-1] < 10, "some steps must succeed"
    schedule = LRSchedule(3e-3, 2, 10, "cosine")  # the one train_worker uses
    for k, (lr, skipped) in enumerate(zip(r["lr"], r["skipped"])):
        assert lr == pytest.approx(schedule(k + 1 - skipped)), "the schedule advances only on steps taken"
    assert r["loss"][-1] < r["loss"][0]


@pytest.mark.parametrize("ds,message", [
    ({**BASE_DS, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "global batch 10 is not a multiple of micro batch 4 x data-parallel size 1"),
    ({**BASE_DS, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
     "train_batch_size 8 != micro batch 2 x gradient_accumulation_steps 3"),
])
def test_refused_batch_sizes(ds, message):
    with pytest.raises(EngineConfigError) as e:
        resolve_ds_config(ds, data_parallel=1, pipeline_parallel=1)
    assert message in str(e.value)


@pytest.mark.parametrize("ds,pp,message", [
    ({**BASE_DS, "zero_optimization": {"stage": 2}}, 2, "ZeRO stage 2 with --pipeline-parallel 2"),
    ({**BASE_DS, "zero_optimization": {"stage": 3}}, 2, "ZeRO stage 3 with --pipeline-parallel 2"),
    ({**BASE_DS, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1, "fp16 and bf16 are both enabled"),
    (BASE_DS, 2, "gradient clipping with --pipeline-parallel in fp32 at ZeRO stage 0"),
    ({**BASE_DS, "fp16": {"enabled": True}}, 1, "fp16 with ZeRO stage 0"),
])
def test_refused_combinations(ds, pp, message):
    """The DeepSpeed settings the layout validator refuses (pipeline.job.layout), before any process group."""
    check = LayoutCheck(Layout(pipeline=pp, zero_stage=zero_stage(ds), precision=precision(ds)), ds=ds)
    with pytest.raises(LayoutError) as e:
        validate(check)
    assert message in str(e.value)


def test_batch_sizes_resolved():
    ds = resolve_ds_config(BASE_DS, data_parallel=2, micro_batch_size=2)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 2, 2)
    assert TINY["vocab_size"] == 256


def _nan_step_worker(rank):
    """bf16, DP 2, ZeRO 1 then 2: rank 1's gradient of one weight is NaN at step 2 only."""
    out = {}
    for stage in (1, 2):
        state = initialize_model_parallel(1, 1)
        model_parallel_seed(1234)
        ds = resolve_ds_config({**BASE_DS, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}},
                               data_parallel=2, pipeline_parallel=1, micro_batch_size=4)
        engine = build_engine(GPTConfig(**TINY), ds, state, init_seed=1234)
        passes = []  # DeepSpeed's separate NaN/Inf pass over the gradients, which the norm makes redundant
        serial = engine.optimizer.has_overflow_partitioned_grads_serial
        engine.optimizer.has_overflow_partitioned_grads_serial = lambda: passes.append(1) or serial()
        backwards = [0]

        def poison(grad):
            backwards[0] += 1
            return torch.full_like(grad, float("nan")) if rank == 1 and backwards[0] == 2 else grad
        dict(engine.module.named_parameters())["layers.1.mlp.fc_in.weight"].register_hook(poison)
        batches = lm_batches(GlobalBatchLoader(real_text_tokens(8 * 3), 8, 4, rank, 2))
        weights = []
        for _ in range(3):
            train_step(engine, batches)
            weights.append([p.detach().clone() for p in engine.module.parameters()])
            out[stage, "skipped", len(weights)] = int(engine.skipped_steps)
        out[stage, "same after the NaN step"] = all(torch.equal(a, b) for a, b in zip(*weights[:2]))
        out[stage, "changed after"] = not all(torch.equal(a, b) for a, b in zip(*weights[1:]))
        out[stage, "finite"] = all(bool(torch.isfinite(p).all()) for p in weights[2])
        out[stage, "separate passes"] = len(passes)
        out[stage, "zero optimizer"] = isinstance(engine.optimizer, DeepSpeedZeroOptimizer)
        out[stage, "averaged"] = engine.optimizer.gradient_average  # skip_reducing_over_one_rank: DP 1 only
    return out


def test_bf16_zero_skips_a_nan_step_by_the_gradient_norm():
    # build_engine drops DeepSpeed's separate NaN/Inf pass in bf16 (skip_nonfinite_steps_by_the_norm): the
    # step with a NaN gradient on one rank must still be skipped on both, and the next one taken
    for r in run_distributed(_nan_step_worker, 2):
        for stage in (1, 2):
            assert r[stage, "zero optimizer"], stage
            assert [r[stage, "skipped", k] for k in (1, 2, 3)] == [0, 1, 1], (stage, r)
            assert r[stage, "same after the NaN step"] and r[stage, "changed after"] and r[stage, "finite"], (stage, r)
            assert r[stage, "separate passes"] == 0, (stage, r)
            assert r[stage, "averaged"], (stage, r)


def _same_losses(recomputed: list, kept: list) -> bool:
    """Recomputation runs the same modules on the same inputs, but a recomputed activation can differ in its last
    bit where a vectorized CPU kernel meets a view at another offset (measured 2026-12-05 on an AVX-512 CPU: llama's
    losses 8.9e-8 apart at PP2, 4.3e-8 at CP2; gpt2's equal; bit for bit on an earlier CPU)."""
    return len(recomputed) == len(kept) and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(recomputed, kept))


def _recompute_zero3_and_pipeline_worker(rank):
    """Every module recomputed (core_attn, mlp_act, layernorm) against none, DP 2 at ZeRO-3 and PP 2 at ZeRO-1,
    gpt2 with dropout 0.1 and untied llama, one launch; the recomputations counted."""
    counted = []
    recompute = DiscardedOutput._recompute
    DiscardedOutput._recompute = lambda self, grad: counted.append(1) or recompute(self, grad)
    out = {}
    models = {"gpt2": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
              "llama": {"variant": "llama", "num_kv_heads": 2, "tie_embeddings": False}}
    for layout, zero, pp in (("ZeRO-3", 3, 1), ("PP2", 1, 2)):
        for variant, model in models.items():
            for policy, modules in (("none", ()), ("selective", ALL_MODULES)):
                counted.clear()
                out[layout, variant, policy] = train_worker(
                    rank, 1, pp, {"zero_optimization": {"stage": zero}}, model, 4, 2 if pp > 1 else None,
                    recompute=policy, recompute_modules=modules)["loss"]
                out[layout, variant, policy, "recomputed"] = len(counted)
    DiscardedOutput._recompute = recompute
    return out


def test_selective_recomputation_under_zero3_and_pipeline_stages():
    # output-discarding recomputation (mlp_act, layernorm) runs a module in the backward: under ZeRO-3 its
    # weights must be gathered again, under PP it runs inside the pipeline engine's backward
    for r in run_distributed(_recompute_zero3_and_pipeline_worker, 2):
        for layout in ("ZeRO-3", "PP2"):
            for variant in ("gpt2", "llama"):
                assert _same_losses(r[layout, variant, "selective"], r[layout, variant, "none"]), (layout, variant, r)
                assert r[layout, variant, "none", "recomputed"] == 0
                assert r[layout, variant, "selective", "recomputed"] > 0, (layout, variant, r)


def _recompute_context_parallel_worker(rank):
    """CP 2 (DeepSpeed-Ulysses), ZeRO-1: every module recomputed against none, gpt2 with dropout 0.1 and llama;
    the checkpoints of the core attention counted."""
    calls = [0]
    checkpoint = deepspeed.checkpointing.checkpoint

    def counting(*args, **kwargs):
        calls[0] += 1
        return checkpoint(*args, **kwargs)
    deepspeed.checkpointing.checkpoint = counting  # build_engine takes it from here
    out = {}
    models = {"gpt2": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
              "llama": {"variant": "llama", "num_kv_heads": 2}}
    for variant, model in models.items():
        for policy, modules in (("none", ()), ("selective", ALL_MODULES)):
            state = initialize_model_parallel(1, 1, context_parallel=2)
            model_parallel_seed(1234)
            ds = resolve_ds_config({**BASE_DS, **Z1}, data_parallel=1, pipeline_parallel=1, micro_batch_size=4)
            engine = build_engine(GPTConfig(**{**TINY, **model}), ds, state, init_seed=1234, recompute=policy,
                                  recompute_modules=modules)
            batches = lm_batches(GlobalBatchLoader(real_text_tokens(8 * 3), 8, 4, 0, 1))  # the same on both
            calls[0] = 0
            out[variant, policy] = [train_step(engine, batches) for _ in range(3)]
            out[variant, policy, "core_attn checkpoints"] = calls[0]
    deepspeed.checkpointing.checkpoint = checkpoint
    return out


def test_selective_recomputation_under_context_parallelism():
    # the core attention is recomputed between Ulysses' all-to-alls (Attention._attend), which are not repeated
    for r in run_distributed(_recompute_context_parallel_worker, 2):
        for variant in ("gpt2", "llama"):
            assert _same_losses(r[variant, "selective"], r[variant, "none"]), (variant, r)
            assert r[variant, "none", "core_attn checkpoints"] == 0
            assert r[variant, "selective", "core_attn checkpoints"] == 3 * 2 * TINY["num_layers"], (variant, r)
