"""The planner against the published scaling of Megatron-LM (Shoeybi et al. 2019) and the mLSTM paper
(Puri et al. 2018), from their setups (docs/performance.md lists what was assumed of them).

Megatron: GPT-2-like models, vocabulary 51,200, 1,024 tokens, fp16 with activation checkpointing of every
layer, micro-batch 8 per model replica; the 1.2B model (h 1536, 40 layers, 16 heads) on one V100 sustains
39 TFLOP/s: the planner's matmul rate is solved so that it predicts exactly that, and the efficiencies of the
8.3B model (h 3072, 72 layers, 32 heads) are its predicted rate per GPU over 39 TFLOP/s. At 512 GPUs the
global batch is 512 (64 replicas of 8) and the gradients are all-reduced in 25 MB buckets during the backward
(PyTorch's DistributedDataParallel).

mLSTM: the three curves of the paper's scaling figure (its code's analysis/scale.md, NVIDIA/sentiment-discovery),
each from one GPU to 16 DGX-1V servers: the 4096- and 8192-unit models over InfiniBand, the 4096-unit one over
Ethernet. 256 sequences of 256 bytes per GPU, fp16 gradients all-reduced after the backward through time (the
weights are shared by all time steps: no gradient is final before the backward ends); speed-up = N x the rate
per GPU at N over the rate at one. The network between servers is the authors' own: "infiniband (200GB/s)" and
"ethernet (10GB/s)", read as 200 and 10 Gb/s a server (a DGX-1V has four 100 Gb/s EDR ports, so 200 GB/s
cannot be meant; 10 Gb/s is the common Ethernet, and it reproduces that curve).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from models import GPTConfig, MLSTMConfig
from pipeline.job.files import atomic_write_figure

from .hardware import hardware
from .layouts import Job, Candidate, predict
from pipeline.families.gpt.shape import gpt_shape
from pipeline.families.mlstm.shape import mlstm_shape

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
    shape = gpt_shape(GPTConfig(variant="gpt2", vocab_size=51200, hidden_size=hidden, num_layers=layers,
                                  num_heads=heads, max_position_embeddings=1024, make_vocab_size_divisible_by=128),
                        f"GPT {hidden}x{layers}")
    return replace(shape, fused_attention=False)  # 2019: softmax(QK^T) materialised


def calibrated_rate(job: Job, lay: Candidate, target: float) -> float:
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
    rate = calibrated_rate(base, Candidate(1, 1, 1, 0, False, "full", 8), MEGATRON_RATE)
    hw = hw.with_sustained(rate / 1e12)
    big = megatron_gpt(3072, 72, 32)
    one_server = predict(Job(big, hw, gpus=8, global_batch=8, precision="fp16", bucket=12.5e6),
                         Candidate(8, 1, 1, 0, False, "full", 8))
    cluster = predict(Job(big, hw, gpus=512, global_batch=512, precision="fp16", bucket=12.5e6),
                      Candidate(8, 1, 64, 0, False, "full", 8))
    return [Row("Megatron 8.3B, TP 8, one DGX-2H: weak-scaling efficiency", 77.0,
                100 * one_server.model_tflops_per_gpu * 1e12 / MEGATRON_RATE, 5.0, "%"),
            Row("Megatron 8.3B, TP 8 x DP 64, 512 V100: weak-scaling efficiency", 76.0,
                100 * cluster.model_tflops_per_gpu * 1e12 / MEGATRON_RATE, 5.0, "%")]


@dataclass(frozen=True)
class ScalingCurve:
    name: str
    hidden: int
    network_bytes_per_s: float  # between servers, one direction, a server
    published: dict              # GPUs -> speed-up over one GPU


# Read off figures/distributed_scalability.png (2.3 pixels a unit, +-0.3); at 8 GPUs (one server) all are ~8.
INFINIBAND, ETHERNET = 200e9 / 8, 10e9 / 8
MLSTM_CURVES = (
    ScalingCurve("mLSTM 4096 over InfiniBand", 4096, INFINIBAND, {16: 13.2, 32: 27.4, 64: 55.6, 128: 109.0}),
    ScalingCurve("mLSTM 8192 over InfiniBand", 8192, INFINIBAND, {16: 15.7, 32: 31.3, 64: 61.3, 128: 120.9}),
    ScalingCurve("mLSTM 4096 over 10 Gb/s Ethernet", 4096, ETHERNET, {16: 11.2, 32: 23.5, 64: 45.7, 128: 92.6}),
)


def mlstm_speedups(curve: ScalingCurve, gpus: tuple = (1, 8, 16, 32, 64, 128)) -> dict:
    hw = replace(hardware("v100-dgx1"), ib_bytes_per_s_per_server=curve.network_bytes_per_s)
    shape = mlstm_shape(MLSTMConfig(hidden_size=curve.hidden, embed_dim=64, seq_length=256), f"mLSTM {curve.hidden}")
    rate = {n: predict(Job(shape, hw, gpus=n, global_batch=256 * n, precision="fp16", overlap_dp=False),
                       Candidate(1, 1, n, 0, False, "none", 256)).model_tflops_per_gpu for n in {1, *gpus}}
    return {n: n * rate[n] / rate[1] for n in gpus}


def mlstm_rows() -> list[Row]:
    return [Row(f"{c.name}, DP 128 on 16 DGX-1V: speed-up over one GPU", c.published[128],
                mlstm_speedups(c, (128,))[128], 0.15 * c.published[128], "x") for c in MLSTM_CURVES]


def validation_rows() -> list[Row]:
    return megatron_rows() + mlstm_rows()


def plot_validation(out: str | Path, dpi: int = 100) -> Path:
    """The mLSTM curves (published points, predicted lines) and the Megatron efficiencies, side by side."""
    # matplotlib only when a chart is drawn
    from matplotlib.figure import Figure  # noqa: PLC0415
    fig = Figure(figsize=(10, 4))
    curves, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    gpus = (1, 8, 16, 32, 64, 128)
    curves.plot(gpus, gpus, "k:", label="linear")
    for i, c in enumerate(MLSTM_CURVES):
        predicted = mlstm_speedups(c, gpus)
        curves.plot(gpus, [predicted[n] for n in gpus], "-" if i != 1 else "--", color=f"C{i}", label=c.name)
        curves.plot(list(c.published), list(c.published.values()), "o", color=f"C{i}")
    curves.set(title="mLSTM data parallel on DGX-1V (Puri et al. 2018)", ylabel="speed-up over one GPU",
               xlabel="GPUs (lines: predicted; points: published)", xticks=gpus)
    rows = megatron_rows()
    x = range(len(rows))
    bars.bar([i - 0.2 for i in x], [r.published for r in rows], 0.4, label="published")
    bars.bar([i + 0.2 for i in x], [r.predicted for r in rows], 0.4, label="predicted")
    bars.set(title="Megatron-LM 8.3B (Shoeybi et al. 2019)", ylabel="weak-scaling efficiency (%)", ylim=(0, 100),
             xticks=list(x), xticklabels=["TP 8, 8 GPUs", "TP 8 x DP 64, 512 GPUs"])
    for ax in (curves, bars):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write_figure(out, fig, dpi)
