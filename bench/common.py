"""Shared pieces of the speed benchmarks: model sizes, matching Hugging Face models, the matmul peak,
FLOP counting, and interleaved (ABAB) timing with medians.

Every benchmark measures the systems it compares side by side in one run, one step of each in turn
(the order rotating every round), so that a machine whose load drifts slows them all alike; ratios are
the median over rounds of the ratio within each round.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import logging
import warnings

import torch  # noqa: E402
from deepspeed.utils import logger
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from models import GPTConfig  # noqa: E402
from pipeline.hf import convert as hf_convert  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Model sizes for a small CPU: vocabulary a multiple of 128 so the project's padded output layer and
# Hugging Face's have the same shape; dropout 0 in every system (DeepSpeed, HF and plain alike).
CPU_SIZES = {
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, vocab_size=8192, seq=256, batch=4),
    "medium": dict(hidden_size=768, num_layers=4, num_heads=12, vocab_size=8192, seq=256, batch=4),  # GPT-2 small width
}
# GPU sizes: GPT-2 medium / XL-like shapes (Megatron's 355M and 1.3B), GPT-2's vocabulary padded to 128.
GPU_SIZES = {
    "350m": dict(hidden_size=1024, num_layers=24, num_heads=16, vocab_size=50304, seq=1024, batch=16),
    "1.3b": dict(hidden_size=2048, num_layers=24, num_heads=16, vocab_size=50304, seq=2048, batch=8),
    "2.7b": dict(hidden_size=2560, num_layers=32, num_heads=32, vocab_size=50304, seq=2048, batch=8),
}
TINY_SIZES = {  # --cpu-smoke of the GPU script and the tests
    "tiny-a": dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, seq=32, batch=2),
    "tiny-b": dict(hidden_size=96, num_layers=2, num_heads=4, vocab_size=512, seq=32, batch=2),
}


def model_config(size: dict, variant: str = "gpt2") -> GPTConfig:
    """The project's config for a size dict (``seq`` and ``batch`` keys are the run's shapes)."""
    shape = {k: v for k, v in size.items() if k not in ("seq", "batch")}
    extra = dict(hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=size["seq"],
                 make_vocab_size_divisible_by=128)
    if variant == "llama":
        # Llama-style: grouped-query attention (half as many KV heads), untied output layer
        extra.update(num_kv_heads=max(1, shape["num_heads"] // 2), tie_embeddings=False)
    return GPTConfig(variant=variant, **shape, **extra)


def hf_config(config: GPTConfig):
    """The ``transformers`` config of the same model (pipeline.hf.convert's, the export's), without a KV cache."""
    if config.vocab_size % config.make_vocab_size_divisible_by:
        raise ValueError(f"vocab_size {config.vocab_size} is not a multiple of {config.make_vocab_size_divisible_by}: "
                         f"the project pads it and Hugging Face would not, so the shapes would differ")
    cfg = hf_convert.hf_config(config)
    cfg.use_cache = False
    return cfg


def hf_model(config: GPTConfig, device="cpu", dtype=torch.float32):
    """GPT2LMHeadModel / LlamaForCausalLM of the same shapes, SDPA attention, training mode."""
    with torch.device(device):  # initialised where it will run (fast for large models on a GPU)
        model = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="sdpa", dtype=dtype)
    return model.to(device).train()


def count_training_flops(model_step: Callable[[], None]) -> int:
    """Matrix-product FLOPs of one forward + backward, counted op by op by ``torch.utils.flop_counter``
    (matmuls, SDPA with no causal discount): the hand count that ``GPTConfig.flops_per_token`` must match.
    Attention runs through SDPA's math backend here so that its products are counted as matmuls on every
    device (the counter knows no CPU flash kernel)."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model_step()
    return counter.get_total_flops()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def matmul_peak(dtype: torch.dtype, device="cpu", n: int | None = None, seconds: float = 0.3,
                clock: str = "wall") -> float:
    """FLOP/s of a square matrix product loop in ``dtype`` (the rate model FLOPs are compared with)."""
    now = CLOCKS[clock]
    if n is None:
        n = 8192 if device != "cpu" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up
    sync(device)
    reps, t0 = 0, now()
    while True:
        for _ in range(4 if device == "cpu" else 20):
            torch.matmul(a, b, out=out)
            reps += 1
        sync(device)
        elapsed = now() - t0
        if elapsed >= seconds:
            return 2.0 * n ** 3 * reps / elapsed


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def autocast(device: str, precision: str):
    """Mixed precision for the plain loops: fp32 weights, bf16/fp16 matmuls (torch.autocast)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=str(device).split(":")[0], dtype=DTYPES[precision])


@dataclass
class System:
    """One contender: ``step()`` runs one full training step (or one unit of work) and blocks until done."""
    name: str
    step: Callable[[], object]
    times: list = field(default_factory=list)     # seconds of each timed call
    results: list = field(default_factory=list)   # what each timed call returned (e.g. a measured rate)
    owner: object = None                          # keeps the model / engine alive while it is timed


def release(system: System) -> None:
    """Free what a system holds: a DeepSpeed engine stays referenced (hooks, groups) until ``destroy()``."""
    destroy = getattr(system.owner, "destroy", None)
    if callable(destroy):
        destroy()
    system.owner = None
    system.step = None


def interleaved(systems: list[System], rounds: int, warmup: int = 1, device="cpu", progress: str | None = None,
                clock: str = "wall"):
    """Warm each system up, then time one step of each per round, the order rotating each round (ABC, BCA, ...).

    ``clock="cpu"`` times with this process's CPU time: on a CPU shared with other jobs it leaves out the time
    the process waited for a core, which is what wall time mostly measures there (one torch thread: CPU time
    = the wall time the step would take on an idle core)."""
    now = CLOCKS[clock]
    for s in systems:
        for _ in range(warmup):
            s.step()
        sync(device)
    for r in tqdm(range(rounds), desc=progress, disable=progress is None, leave=False, dynamic_ncols=True):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            sync(device)
            t0 = now()
            result = s.step()
            sync(device)
            s.times.append(now() - t0)
            s.results.append(result)
    return {s.name: s.times for s in systems}


def median(xs):
    return statistics.median(xs)


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[r] / den[r] (times from the same round: robust to load drift)."""
    return statistics.median(a / b for a, b in zip(num, den))


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c):
    if isinstance(c, float):
        if c == 0 or abs(c) >= 100:
            return f"{c:,.0f}"
        if abs(c) >= 10:
            return f"{c:.1f}"
        return f"{c:.2f}" if abs(c) >= 0.1 else f"{c:.3f}"
    return str(c)


def quiet_deepspeed():
    warnings.filterwarnings("ignore")
    logger.setLevel(logging.ERROR)


def machine_note(device="cpu") -> str:
    if str(device).startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s), load average {load:.1f}, "
            f"torch {torch.__version__}")
