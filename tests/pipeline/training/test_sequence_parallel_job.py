"""Sequence parallelism through the main job and the engine: per-step losses equal the single process at
(TP2, SP), (TP2, SP, PP2), (TP2, SP, DP2, ZeRO-1/2/3); activation checkpointing is exact with dropout;
SP checkpoints load without SP, at another TP size, and export to Hugging Face; refusals before any work."""
import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from dist import run_distributed
from engine_utils import train_worker
from run_utils import write_corpus
from test_checkpoint import DS, MODEL, _pretrain, args, losses
from transformers import AutoModelForCausalLM

from models import GPT
from pipeline.checkpoints import checkpoint
from pipeline.job.errors import command
from pipeline.export_hf import main as export_main
from pipeline.pretrain import main
from pipeline.checkpoints.state_dicts import load_full_state_dict

NODROP = {**MODEL, "hidden_dropout": 0.0, "attention_dropout": 0.0}
LLAMA = {"variant": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "max_position_embeddings": 32, "tie_embeddings": False, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
STEPS = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    write_corpus(d)
    (d / "model.json").write_text(json.dumps(MODEL))
    (d / "nodrop.json").write_text(json.dumps(NODROP))
    (d / "ds.json").write_text(json.dumps(DS))
    (d / "ds_z2.json").write_text(json.dumps({**DS, "zero_optimization": {"stage": 2}}))
    return d


def _job(setup, save, world, *extra, steps=STEPS, ds="ds.json"):
    argv = args(setup, save, steps, "--micro-batch-size", "2", *extra, model="nodrop.json")
    argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
    run_distributed(_pretrain, world, argv)
    return losses(save)


def _max_rel(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want) == list(range(1, len(want) + 1))
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in want)


@pytest.fixture(scope="module")
def single(setup):
    return _job(setup, setup / "single", 1, "--save-interval", "2")


@pytest.mark.parametrize("layout,world,extra,ds", [
    ("TP2 SP", 2, ("--tensor-parallel", "2"), "ds.json"),
    ("TP2 SP PP2", 4, ("--tensor-parallel", "2", "--pipeline-parallel", "2"), "ds.json"),
    ("TP2 SP DP2 ZeRO-2", 4, ("--tensor-parallel", "2"), "ds_z2.json"),
])
def test_main_job_sequence_parallel_equals_single_process(setup, single, layout, world, extra, ds):
    got = _job(setup, setup / layout.replace(" ", "_"), world, *extra, "--sequence-parallel", "--save-interval", "2",
               ds=ds)
    rel = _max_rel(got, single)
    print(f"{layout}: max relative loss difference over {STEPS} steps {rel:.2e}")
    assert rel < 1e-6, (layout, got, single)  # (the composition matrix measures <= 1.4e-7 at these layouts)


LLAMA_UNTIED = {"variant": "llama", "tie_embeddings": False, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def engine_refs():
    """Single-process losses of the engine tests' tiny gpt2 and llama (fp32, dropout 0)."""
    return {"gpt2": run_distributed(train_worker, 1)[0]["loss"],
            "llama": run_distributed(train_worker, 1, 1, 1, None, LLAMA_UNTIED)[0]["loss"]}


@pytest.mark.parametrize("stage,variant", [(1, "gpt2"), (3, "llama")])
def test_engine_sequence_parallel_zero_stages(engine_refs, stage, variant):
    """(TP2, SP, DP2) under ZeRO-1 (gpt2: LayerNorms, row-parallel biases, positions) and ZeRO-3 (llama:
    RMSNorms, untied output layer)."""
    model = {**(LLAMA_UNTIED if variant == "llama" else {}), "sequence_parallel": True}
    for r in run_distributed(train_worker, 4, 2, 1, {"zero_optimization": {"stage": stage}}, model):
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], engine_refs[variant]))
        print(f"{variant} TP2 SP DP2 ZeRO-{stage}: max relative loss difference {rel:.2e}")
        assert rel < 1e-5, (stage, variant, r["loss"], engine_refs[variant])


def test_activation_checkpointing_with_dropout_is_exact_under_sp():
    """Dropout in the sequence-split region (model-parallel RNG) and in attention: recomputation redraws the
    very same masks, at PP 1 and through the pipeline engine's checkpointing."""
    drop = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "sequence_parallel": True}
    plain = run_distributed(train_worker, 2, 2, 1, None, drop)
    ckpt = run_distributed(train_worker, 2, 2, 1, None, drop, 5, None, "full")
    assert plain[0]["loss"] == ckpt[0]["loss"]
    nodrop = run_distributed(train_worker, 2, 2, 1, None, {"sequence_parallel": True})
    assert plain[0]["loss"] != nodrop[0]["loss"]  # the dropout did act


def test_sequence_parallel_checkpoint_loads_anywhere_and_exports(setup, single, tmp_path):
    """Saved at (TP2, SP): resumes at TP2 without SP, reshards to TP1, and its Hugging Face export gives the
    logits of the model it holds."""

    src = setup / "TP2_SP"
    if not (src / "global_step2").is_dir():
        _job(setup, src, 2, "--tensor-parallel", "2", "--sequence-parallel", "--save-interval", "2")
    want = losses(src)
    assert "sequence_parallel" not in json.loads((src / "config.json").read_text())
    for name, world, extra in (("no_sp", 2, ("--tensor-parallel", "2")), ("tp1", 1, ())):
        got = _job(setup, tmp_path / name, world, *extra, "--load", str(src), "--load-tag", "global_step2", steps=3)
        rel = abs(got[3] - want[3]) / want[3]
        print(f"(TP2, SP) step 2 -> {name}: step-3 loss {got[3]!r} vs {want[3]!r}, rel {rel:.2e}")
        assert sorted(got) == [3] and rel < 1e-5
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(src), "--out", str(out)]) == 0
    config, full, _ = checkpoint.read_full_checkpoint(src)
    model = GPT(config).eval()
    load_full_state_dict(model, full)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([list(b"def load(p):\n    return p")])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"export of a (TP2, SP) checkpoint: max relative logit difference {rel:.2e}")
    assert rel < 1e-5


def _refused(tmp_path, setup, *extra, ds="ds.json"):
    env = {"PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    argv = args(setup, tmp_path / "run", 1, *extra, model="nodrop.json")
    argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
    proc = subprocess.run([sys.executable, "-m", "pipeline.pretrain", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr[-3000:]
    return proc.stderr


def test_refusals_before_any_work(setup, tmp_path):
    err = _refused(tmp_path, setup, "--sequence-parallel")
    assert err.strip().splitlines()[-1].startswith("error: --sequence-parallel splits the sequence"), err
    assert "does nothing with --tensor-parallel 1" in err and "Traceback" not in err


def _refusal_worker(rank, argv):

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            command(main)(argv)  # the command-line entry point: its handler turns a user error into one line
        except SystemExit as e:
            return e.code, stderr.getvalue()
    return 0, stderr.getvalue()


def test_refusals_at_tp2(setup, tmp_path):
    (setup / "ds_part.json").write_text(json.dumps({**DS, "activation_checkpointing": {"partition_activations": True}}))
    cases = [(("--seq-length", "31"), "ds.json", "seq_length 31 is not divisible by 2"),
             ((), "ds_part.json", "partition_activations splits activations")]
    for extra, ds, message in cases:
        argv = args(setup, tmp_path / ds, 1, "--tensor-parallel", "2", "--sequence-parallel", model="nodrop.json")
        argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
        argv += list(extra)
        (code0, err0), (code1, err1) = run_distributed(_refusal_worker, 2, argv)
        assert code0 == code1 == 2 and message in err0 and err0.count("error: ") == 1, (err0, err1)
        assert "error: " not in err1  # rank 0 only
        assert not (tmp_path / ds).exists()


def test_half_precision_under_sp(engine_refs):
    """bf16 follows the fp32 single process closely; fp16's dynamic loss scale skips the overflowing first
    step and trains on (the SP gradient sums are taken in fp32 and keep an inf an inf)."""
    ref = engine_refs["gpt2"]
    bf16 = run_distributed(train_worker, 2, 2, 1, {"bf16": {"enabled": True}}, {"sequence_parallel": True})[0]
    rel = max(abs(a - b) / b for a, b in zip(bf16["loss"], ref))
    print(f"bf16 TP2 SP vs fp32 TP1: max relative loss difference {rel:.2e}")
    assert rel < 2e-2
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "hysteresis": 1,
                     "min_loss_scale": 1}, "zero_optimization": {"stage": 1}}
    r = run_distributed(train_worker, 2, 2, 1, fp16, {"sequence_parallel": True}, 8, None, "none", True)[0]
    print("fp16 TP2 SP scales", r["scale"], "skipped", r["skipped"], "loss", r["loss"])
    assert r["skipped"][0] == 1 and r["scale"][0] == 2.0**19 and r["skipped"][-1] < 8
    assert r["loss"][-1] < r["loss"][0]
