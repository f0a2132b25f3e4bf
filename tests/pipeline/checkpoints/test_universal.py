"""Universal checkpoints: a run resumed at another TP / PP / DP size or ZeRO stage continues with its optimizer state.

For each transition one uninterrupted 4-step run at the first layout (saving at steps 2 and 4) is
the reference; its step-2 checkpoint is resumed at the second layout for steps 3-4. The losses of
steps 3-4 and the fp32 weights and Adam moments saved at step 4 (gathered through the universal
format, full TP=1 tensors under the GPT's names) must match the reference's.
"""
import json
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from run_utils import NO_DROPOUT, TINY_GPT2, ds_config, pretrain_worker, write_corpus

from pipeline.checkpoints import checkpoint, universal
from pipeline.export_hf import main as export_main
from pipeline.checkpoints.reshard import reshard

MODEL = {**TINY_GPT2, **NO_DROPOUT}
# the llama variant's fused projections under GQA: QKV rows of 4 query and 2 KV heads, gate-up of SwiGLU
LLAMA_GQA = {"variant": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 64, "max_position_embeddings": 32, "tie_embeddings": False,
             "make_vocab_size_divisible_by": 8, **NO_DROPOUT}


# name: (tensor parallel, pipeline parallel, world size, ZeRO stage, fp16)
LAYOUTS = {"tp1": (1, 1, 1, 1, False), "tp2": (2, 1, 2, 1, False), "pp2": (1, 2, 2, 1, False),
           "tp2pp2": (2, 2, 4, 1, False), "dp2": (1, 1, 2, 1, False), "dp2z2": (1, 1, 2, 2, False),
           "dp1z2": (1, 1, 1, 2, False), "dp2z3": (1, 1, 2, 3, False), "dp2fp16": (1, 1, 2, 1, True),
           "dp1fp16": (1, 1, 1, 1, True), "tp2z0": (2, 1, 2, 0, False), "tp1z0": (1, 1, 1, 0, False)}
TRANSITIONS = [("tp1", "tp2"), ("tp2", "tp1"), ("pp2", "tp1"), ("tp2pp2", "dp2"), ("dp2z2", "dp1z2"),
               ("tp1", "dp2z3"), ("dp2fp16", "dp1fp16"), ("tp2z0", "tp1"), ("tp1z0", "dp2z3"),
               ("tp1", "tp2z0"), ("dp2z2", "tp1z0"), ("tp2z0", "tp1z0")]
RESHARDED = {("tp2", "tp1"), ("tp2z0", "tp1z0")}  # through ``python -m pipeline.reshard``, the rest on --load


_pretrain = pretrain_worker  # fp16: DeepSpeed's CPU accelerator refuses it unless told otherwise


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("universal")
    write_corpus(d)
    (d / "model.json").write_text(json.dumps(MODEL))
    (d / "llama.json").write_text(json.dumps(LLAMA_GQA))
    return d


def run(setup, layout, save, *extra, worker=None, model="model.json"):
    tp, pp, world, stage, fp16 = LAYOUTS[layout]
    ds = setup / f"ds_{layout}.json"
    ds.write_text(json.dumps(ds_config(stage, fp16)))
    argv = ["--model-config", str(setup / model), "--deepspeed_config", str(ds), "--data",
            str(setup / "corpus.txt"), "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "2",
            "--train-steps", "4", "--cache-dir", str(setup / "cache"), "--save", str(save), "--micro-batch-size", "2",
            "--tensor-parallel", str(tp), "--pipeline-parallel", str(pp), *extra]
    run_distributed(worker or _pretrain, world, argv, fp16)
    return save


def losses(save):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(save) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


_references = {}


def reference(setup, layout):
    """The uninterrupted 4-step run at ``layout`` (saved at steps 2 and 4), shared by the transitions from it."""
    if layout not in _references:
        _references[layout] = run(setup, layout, setup / f"ref_{layout}", "--save-interval", "2")
    return _references[layout]


def optimizer_state(run_dir, tag="global_step4") -> dict:
    """{(parameter, fp32 | exp_avg | exp_avg_sq): full tensor} of a checkpoint, through its universal form."""
    cache = universal.ensure_cache(run_dir, tag, log=lambda *_: None)
    out = {}
    for folder in sorted((cache / "zero").iterdir()):
        if folder.is_dir():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                out[folder.name, key] = torch.load(folder / f"{key}.pt", weights_only=True)["param"]
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()  # (DeepSpeed saves some fp32 masters with requires_grad set)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def comparable(name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The key bias of attention has no gradient in exact arithmetic (softmax ignores a shift of every
    score), so Adam turns its rounding noise (~1e-13) into updates of order lr: those rows of the weight
    differ between any two summation orders. Its moments are noise of that size and stay in."""
    if key == "fp32" and name.endswith("attention.qkv.bias"):
        q, k, v = tensor.chunk(3)
        return torch.cat([q, v])
    return tensor


@pytest.mark.parametrize("source,target", TRANSITIONS, ids=[f"{s}-{t}" for s, t in TRANSITIONS])
def test_resume_at_another_layout_continues_exactly(setup, source, target):
    ref = reference(setup, source)
    load = ref
    if (source, target) in RESHARDED:  # these through the offline conversion
        from pipeline.reshard import main as reshard_main
        load = setup / f"resharded_{source}"
        cached = (ref / "universal" / "global_step2").exists()  # by an earlier --load of this reference
        assert reshard_main(["--checkpoint", str(ref), "--out", str(load), "--tag", "global_step2"]) == 0
        assert (ref / "universal" / "global_step2").exists() == cached  # the source is not written to
    resumed = run(setup, target, setup / f"resumed_{source}_{target}", "--load", str(load), "--load-tag",
                  "global_step2")
    want, got = losses(ref), losses(resumed)
    assert sorted(got) == [3, 4]
    diffs = {s: abs(got[s] - want[s]) / want[s] for s in (3, 4)}
    print(f"{source} -> {target}: step 3-4 loss relative differences {diffs[3]:.2e} {diffs[4]:.2e}")
    for s in (3, 4):
        assert diffs[s] < 1e-5, f"step {s}: {got[s]!r} vs {want[s]!r}"
    theirs, ours = optimizer_state(ref), optimizer_state(resumed)
    assert sorted(ours) == sorted(theirs)
    rel = {k: rel_diff(comparable(*k, ours[k]), comparable(*k, theirs[k])) for k in theirs}
    print(f"{source} -> {target}: step-4 worst relative difference: weights "
          f"{max(v for k, v in rel.items() if k[1] == 'fp32'):.2e}, Adam moments "
          f"{max(v for k, v in rel.items() if k[1] != 'fp32'):.2e}")
    # fp16 computes the gradients in half precision: summed over another DP size they round differently
    # (fp16's epsilon is 1e-3), where fp32 agrees to its own rounding
    tolerance = 2e-3 if LAYOUTS[source][4] else 1e-6
    for key, value in rel.items():
        assert value < tolerance, key


def test_what_cannot_carry_the_optimizer_state_says_why():
    """Layouts whose optimizer state has no universal form resume with the weights only (and a warning naming
    the reason); fp32 ZeRO-0 without pipelines carries it at either end."""
    fp32_z0 = {"universal_info": True, "zero_stage": 0, "precision": "fp32", universal.OPTIMIZER_PARAM_NAMES: True}
    zero1 = {"universal_info": True, "zero_stage": 1, "precision": "fp32"}
    assert universal.unsupported_reason(fp32_z0, zero1) is None
    assert universal.unsupported_reason(zero1, {**fp32_z0, "tensor_parallel": 2}) is None
    refused = [({**fp32_z0, "precision": "fp16"}, zero1), ({**fp32_z0, "pipeline_parallel": 2}, zero1),
               ({**fp32_z0, universal.OPTIMIZER_PARAM_NAMES: False}, zero1),  # saved before the names were
               (zero1, {**fp32_z0, "precision": "bf16"}), (zero1, {**fp32_z0, "pipeline_parallel": 2}),
               ({**zero1, "universal_info": False}, zero1)]
    for saved, current in refused:
        assert universal.unsupported_reason(saved, current), (saved, current)


def test_llama_gqa_fused_projections_resume_at_another_tp_size(setup):
    """TP 1 -> 2 and back for the llama variant with grouped-query attention: its fused QKV (4 query, 2 KV
    heads) and gate-up weights are re-cut by their SubparamShape, moments included."""
    ref = run(setup, "tp2", setup / "ref_llama_tp2", "--save-interval", "2", model="llama.json")
    resumed = run(setup, "tp1", setup / "resumed_llama_tp1", "--load", str(ref), "--load-tag", "global_step2",
                  model="llama.json")
    want, got = losses(ref), losses(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) / want[step] < 1e-5, (step, got[step], want[step])
    theirs, ours = optimizer_state(ref), optimizer_state(resumed)
    assert sorted(ours) == sorted(theirs) and any("qkv" in k[0] for k in ours)
    worst = max(rel_diff(ours[k], theirs[k]) for k in theirs)
    print(f"llama GQA tp2 -> tp1: step 3-4 loss differences {abs(got[3] - want[3]) / want[3]:.2e} "
          f"{abs(got[4] - want[4]) / want[4]:.2e}, worst weight/moment difference {worst:.2e}")
    assert worst < 1e-6


def test_a_resharded_run_reads_and_exports_as_its_source(setup, tmp_path):
    """pipeline.reshard's output holds the weights only in universal form: reading it (export, evaluation,
    finetuning) gives the source's weights, and it exports to Hugging Face like its source."""
    ref = reference(setup, "tp2")
    out = reshard(ref, tmp_path / "resharded", "global_step2")
    config, theirs, _ = checkpoint.read_full_checkpoint(ref, "global_step2")
    config2, ours, tokenizer = checkpoint.read_full_checkpoint(out)
    assert config2 == config and tokenizer is not None and sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name].float()), name
    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "hf"), "--verify"]) == 0


def test_damaged_cache_is_rebuilt(setup):
    """A universal cache that lost a file, or its manifest, is never used: it is removed and converted again."""
    ref = reference(setup, "tp1")
    messages = []
    cache = universal.ensure_cache(ref, "global_step2", log=messages.append)
    original = optimizer_state(ref, "global_step2")
    victim = cache / "zero" / "layers.0.attention.qkv.weight" / "exp_avg.pt"
    victim.write_bytes(victim.read_bytes()[:64])
    assert universal.ensure_cache(ref, "global_step2", log=messages.append) == cache
    assert "exp_avg.pt has 64 bytes" in messages[-1] and "rebuilding" in messages[-1]
    (cache / universal.MANIFEST).unlink()  # e.g. a copy of the run that left the manifest behind
    universal.ensure_cache(ref, "global_step2", log=messages.append)
    assert f"no {universal.MANIFEST}" in messages[-1]
    rebuilt = optimizer_state(ref, "global_step2")
    assert sorted(rebuilt) == sorted(original)
    for key in original:
        assert torch.equal(rebuilt[key], original[key]), key
    assert not list((ref / "universal").glob(".*")), "temporary or removed caches left behind"


MLSTM = {"model_type": "mlstm", "embed_dim": 16, "hidden_size": 32, "num_layers": 1, "seq_length": 16,
         "weight_norm": "all"}


@pytest.mark.parametrize("src_dp,src_stage,dst_dp,dst_stage", [(2, 1, 1, 2), (1, 0, 2, 1), (2, 1, 1, 0)],
                         ids=["dp2z1-dp1z2", "dp1z0-dp2z1", "dp2z1-dp1z0"])
def test_mlstm_changes_dp_size_and_zero_stage_with_its_optimizer_state(setup, tmp_path, src_dp, src_stage, dst_dp,
                                                                       dst_stage):
    """mLSTM resumed at another DP size and ZeRO stage (0 included): Adam's step count and second moments carry
    on (v3 >= beta2 * v2 everywhere, which a restarted optimizer, v3 = (1 - beta2) g^2, breaks)."""
    (setup / "mlstm.json").write_text(json.dumps(MLSTM))
    common = ["--model-config", str(setup / "mlstm.json"), "--data", str(setup / "corpus.txt"), "--seq-length",
              "16", "--lr-warmup-steps", "1", "--cache-dir", str(setup / "cache"), "--micro-batch-size", "2"]
    for stage in (src_stage, dst_stage):
        (setup / f"ds_mlstm_z{stage}.json").write_text(json.dumps(ds_config(stage)))
    src, dst = tmp_path / "src", tmp_path / "dst"
    run_distributed(_pretrain, src_dp, [*common, "--deepspeed_config", str(setup / f"ds_mlstm_z{src_stage}.json"),
                                        "--train-steps", "2", "--save", str(src)], False)
    run_distributed(_pretrain, dst_dp, [*common, "--deepspeed_config", str(setup / f"ds_mlstm_z{dst_stage}.json"),
                                        "--train-steps", "3", "--save", str(dst), "--load", str(src)], False)
    assert sorted(losses(dst)) == [3]
    before, after = optimizer_state(src, "global_step2"), optimizer_state(dst, "global_step3")
    assert sorted(before) == sorted(after)
    for name, key in before:
        step = torch.load(universal.cache_path(dst, "global_step3") / "zero" / name / "step.pt", weights_only=True)
        assert int(step) == 3, name
        if key == "exp_avg_sq":
            assert bool((after[name, key] >= 0.999 * before[name, key] * (1 - 1e-5)).all()), name


def test_an_fp8_run_resumes_in_bf16_at_another_layout_and_back(setup, tmp_path):
    """FP8 is a compute format only: a bf16 run at TP 2 with --fp8 tensorwise resumes at TP 1 in bf16 without
    FP8, and that run at TP 2 with --fp8 rowwise, each with its optimizer state (Adam's step count, and v_next >=
    beta2 * v everywhere, which a restarted optimizer, v = (1 - beta2) g^2, breaks)."""
    (setup / "ds_bf16.json").write_text(json.dumps({**ds_config(1), "bf16": {"enabled": True}}))
    common = ["--model-config", str(setup / "model.json"), "--deepspeed_config", str(setup / "ds_bf16.json"),
              "--data", str(setup / "corpus.txt"), "--tokenizer", "bytes", "--seq-length", "32",
              "--lr-warmup-steps", "1", "--cache-dir", str(setup / "cache"), "--micro-batch-size", "2"]
    runs = [(tmp_path / "fp8_tp2", 2, ["--fp8", "tensorwise"]), (tmp_path / "bf16_tp1", 1, []),
            (tmp_path / "fp8_rowwise_tp2", 2, ["--fp8", "rowwise"])]
    previous = None
    for step, (save, world, fp8) in enumerate(runs, start=2):
        load = ["--load", str(previous)] if previous else []
        run_distributed(_pretrain, world, [*common, "--tensor-parallel", str(world), "--train-steps", str(step),
                                           "--save", str(save), *load, *fp8], False)
        record = json.loads((save / f"global_step{step}" / "layout.json").read_text())
        assert record["fp8"] == (fp8[1] if fp8 else None) and record["precision"] == "bf16"
        if previous:
            assert sorted(losses(save)) == [step]
            before = optimizer_state(previous, f"global_step{step - 1}")
            after = optimizer_state(save, f"global_step{step}")
            assert sorted(before) == sorted(after)
            for name, key in before:
                step_file = universal.cache_path(save, f"global_step{step}") / "zero" / name / "step.pt"
                count = torch.load(step_file, weights_only=True)
                assert int(count) == step, name
                if key == "exp_avg_sq":
                    assert bool((after[name, key] >= 0.999 * before[name, key] * (1 - 1e-5)).all()), name
        previous = save
