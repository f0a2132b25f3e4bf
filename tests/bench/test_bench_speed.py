"""The speed work: the FLOP count MFU rests on, the fast paths' numerics, and the GPU benchmark's CPU smoke run.

No timings are asserted here (speed is measured in bench/); these check what the numbers stand on.
"""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models import GPT, GPTConfig
from models.gpt import RotaryEmbedding, _rotate_half
from models.parallel import vocab_parallel_cross_entropy
from pipeline.job.layout import LayoutError
from pipeline.pretrain import main
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402  (bench/common.py, on the path from here)


@pytest.mark.parametrize("model", [
    dict(variant="gpt2"),
    dict(variant="llama", num_kv_heads=2, tie_embeddings=False),
    dict(variant="llama", num_kv_heads=4, tie_embeddings=True, ffn_hidden_size=96),
])
def test_flops_per_token_matches_counted_flops(model):
    # PaLM's 6N + 12 L h s against torch's op-by-op count of one forward + backward (attention unmasked)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=32,
                       hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=128, **model)
    gpt = GPT(config, init_seed=0)
    tokens = torch.randint(0, config.vocab_size, (3, 17))
    counted = common.count_training_flops(lambda: gpt(tokens[:, :-1], tokens[:, 1:]).backward())
    assert counted == config.flops_per_token(16) * 3 * 16


def test_flops_per_token_by_hand():
    c = GPTConfig(vocab_size=1000, hidden_size=8, num_layers=2, num_heads=2, max_position_embeddings=4)
    per_layer = 8 * 24 + 8 * 8 + 2 * 8 * 32  # qkv, output projection, MLP in and out
    assert c.flops_per_token(4) == 6 * (2 * per_layer + 1000 * 8) + 12 * 2 * 8 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_low_precision_logits_padding(dtype, smoothing):
    # bf16 logits take the cast-then-in-place path; padding columns (50 of 64 valid) get no probability
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 50, (3, 5), generator=g)
    target[0, 2] = -100
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=50, label_smoothing=smoothing)
    loss.backward()
    ref_logits = logits.detach().float()[..., :50].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 50), target.reshape(-1), label_smoothing=smoothing)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == dtype
    tol = dict(rtol=0, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)  # bf16 rounding
    torch.testing.assert_close(logits.grad.float()[..., :50], ref_logits.grad, **tol)
    assert torch.all(logits.grad[..., 50:] == 0)


def test_rotary_tables_cached_and_usable_after_inference_mode():
    rope = RotaryEmbedding(head_dim=8, theta=10000.0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    with torch.inference_mode():
        rope(torch.randn(1, 1, 9, 8), torch.randn(1, 1, 9, 8))  # caches 9 positions
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    emb = torch.cat([torch.outer(torch.arange(5).float(), inv)] * 2, dim=-1)
    q.requires_grad_()
    rq, rk = rope(q, k)
    assert torch.equal(rq, q * emb.cos() + _rotate_half(q) * emb.sin())
    assert torch.equal(rk, k * emb.cos() + _rotate_half(k) * emb.sin())
    rq.sum().backward()  # the cached tables (made under inference_mode) can be saved for backward
    assert q.grad is not None


def test_gpu_script_cpu_smoke(tmp_path):
    # the H200 script end to end on tiny models: DeepSpeed bf16 and fp16 (loss scaling) beside HF
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_h200.py"), "--cpu-smoke", "--sizes", "tiny-a",
                          "--precisions", "bf16,fp16", "--systems", "deepspeed,hf", "--steps", "1", "--warmup", "1",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]
    assert {(r["precision"], r["system"]) for r in rows} == {(p, s) for p in ("bf16", "fp16")
                                                             for s in ("deepspeed", "hf")}
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu_measured_peak"] and torch.isfinite(torch.tensor(r["last_loss"]))
    assert next(r for r in rows if r["precision"] == "fp16" and r["system"] == "deepspeed")["loss_scale"] > 1
    assert "MFU (measured peak)" in out.stdout


def test_gpu_script_profiles_each_recompute_policy_and_model_family(tmp_path):
    # --variants, --recompute (DeepSpeed systems only), the FP8 system and --profile's step by kernel kind
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_h200.py"), "--cpu-smoke", "--sizes", "tiny-a",
                          "--precisions", "bf16", "--variants", "gpt2,llama", "--recompute", "none,full",
                          "--systems", "deepspeed,deepspeed+fp8,hf", "--steps", "1", "--warmup", "1", "--profile", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]
    assert sorted((r["variant"], r["system"], r["recompute"]) for r in rows) == sorted(
        (v, s, p) for v in ("gpt2", "llama") for s in ("deepspeed", "deepspeed+fp8", "hf")
        for p in (("none", "full") if s != "hf" else ("none",)))
    for r in rows:
        prof = r["profile"]
        # (at these lengths a CPU computes the attention as plain matrix products: models.gpt.short_causal_attention)
        assert prof["by_kind_s"]["matmul"] > 0 and prof["by_kind_s"]["optimizer"] > 0
        assert 0 < prof["busy_fraction"] <= 1.0 + 1e-6 and prof["top"]


def test_pretrain_compile_refuses_zero3(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher of two ranks would: the layout is refused before joining
    with pytest.raises(LayoutError, match="--compile with ZeRO stage 3"):
        main(["--compile", "--deepspeed_config", str(ROOT / "ds_configs" / "zero3.json")])
