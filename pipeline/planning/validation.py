"""The planner against the published scaling of Megatron-LM (Shoeybi et al. 2019) and the mLSTM paper
(Puri et al. 2018), from their setups (docs/performance.md lists what was assumed of them).

Megatron: GPT-2-like models, vocabulary 51,200, 1,024 tokens, fp16 with activation checkpointing of every
layer, micro-batch 8 per model replica; the 1.2B model (h 1536, 40 layers, 16 heads) on one V100 sustains
39 TFLOP/s: the planner's matmul rate is solved so that it predicts exactly that, and the efficiencies of the
8.3B model (h 3072, 72 layers, 32 heads) are its predicted rate per GPU over 39 TFLOP/s. At 512 GPUs the
global batch is 512 (64 replicas of 8) and the gradients are all-reduced in 25 MB buckets during the backward
(PyTorch's DistributedDataParallel).

mLSTM: the 4096-unit model (models/configs/mlstm-4096.json), 256 bytes per sequence, 256 sequences per GPU
(32k over 128 GPUs, 16 DGX-1V servers), fp16 gradients all-reduced after the backward through time (the
weights are shared by all time steps: no gradient is final before the backward ends); speed-up = 128 x the
rate per GPU at 128 over the rate at one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from models import GPTConfig, MLSTMConfig

from .hardware import hardware
from .layouts import Job, Layout, predict
from .shapes import model_shape

MEGATRON_RATE = 39e12


@dataclass(frozen=True)
class Row:
    name: str
    published: float
    predicted: float
    tolerance: float      # absolute, in the row's unit
    unit: str

    @property
    def difference(self) -> float:
        return self.predicted - self.published

    @property
    def ok(self) -> bool:
        return abs(self.difference) <= self.tolerance


def megatron_gpt(hidden: int, layers: int, heads: int):
    shape = model_shape(GPTConfig(variant="gpt2", vocab_size=51200, hidden_size=hidden, num_layers=layers,
                                  num_heads=heads, max_position_embeddings=1024, make_vocab_size_divisible_by=128),
                        f"GPT {hidden}x{layers}")
    return replace(shape, fused_attention=False)  # 2019: softmax(QK^T) materialised


def calibrated_rate(job: Job, lay: Layout, target: float) -> float:
    """The matmul rate at which ``lay`` of ``job`` runs at ``target`` model FLOP/s per GPU (bisection)."""
    lo, hi = target, 20 * target
    for _ in range(60):
        mid = (lo + hi) / 2
        j = replace(job, hardware=job.hardware.with_sustained(mid / 1e12))
        lo, hi = (mid, hi) if predict(j, lay).model_tflops_per_gpu * 1e12 < target else (lo, mid)
    return (lo + hi) / 2


def megatron_rows() -> list[Row]:
    hw = hardware("v100-dgx2h")
    base = Job(megatron_gpt(1536, 40, 16), hw, gpus=1, global_batch=8, precision="fp16", bucket=12.5e6)
    rate = calibrated_rate(base, Layout(1, 1, 1, 0, False, "full", 8), MEGATRON_RATE)
    hw = hw.with_sustained(rate / 1e12)
    big = megatron_gpt(3072, 72, 32)
    one_server = predict(Job(big, hw, gpus=8, global_batch=8, precision="fp16", bucket=12.5e6),
                         Layout(8, 1, 1, 0, False, "full", 8))
    cluster = predict(Job(big, hw, gpus=512, global_batch=512, precision="fp16", bucket=12.5e6),
                      Layout(8, 1, 64, 0, False, "full", 8))
    return [Row("Megatron 8.3B, TP 8, one DGX-2H: weak-scaling efficiency", 77.0,
                100 * one_server.model_tflops_per_gpu * 1e12 / MEGATRON_RATE, 5.0, "%"),
            Row("Megatron 8.3B, TP 8 x DP 64, 512 V100: weak-scaling efficiency", 76.0,
                100 * cluster.model_tflops_per_gpu * 1e12 / MEGATRON_RATE, 5.0, "%")]


def mlstm_rows() -> list[Row]:
    hw = hardware("v100-dgx1")
    shape = model_shape(MLSTMConfig(hidden_size=4096, embed_dim=64, seq_length=256), "mLSTM 4096")
    rates = {}
    for gpus in (1, 128):
        job = Job(shape, hw, gpus=gpus, global_batch=256 * gpus, precision="fp16", overlap_dp=False)
        rates[gpus] = predict(job, Layout(1, 1, gpus, 0, False, "none", 256)).model_tflops_per_gpu
    return [Row("mLSTM 4096, DP 128 on 16 DGX-1V: speed-up over one GPU", 109.0, 128 * rates[128] / rates[1],
                0.15 * 109.0, "x")]


def validation_rows() -> list[Row]:
    return megatron_rows() + mlstm_rows()
