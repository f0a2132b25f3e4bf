"""Whether this CPU computes bf16 in hardware: without AVX512-BF16 or AMX-BF16 a bf16 step is emulated in fp32
(about 100x slower than fp32 itself on an AVX2-only CPU: the E-c recipe's step took ~150 s), so a bf16 DeepSpeed
config on such a CPU is said at start, with what to run instead."""
from __future__ import annotations

import sys
from pathlib import Path

from deepspeed.accelerator import get_accelerator

from pipeline.job.errors import is_rank0

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo's names of the bf16 instructions
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a /proc/cpuinfo text (empty when it has none: not Linux x86)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_cpu_warning(precision: str, device: str, flags: frozenset[str]) -> str | None:
    """The one warning line for a bf16 run on a CPU whose ``flags`` lack the bf16 instructions, else None (an
    unknown CPU, no flags at all, is not warned about)."""
    if precision != "bf16" or device != "cpu" or not flags or flags & BF16_FLAGS:
        return None
    return ("warning: bf16 on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): each "
            "step is emulated, about 100x slower than fp32; run in fp32 instead (--deepspeed_config "
            "ds_configs/cpu.json with \"bf16\": {\"enabled\": false}, or a config without a bf16 section)")


def warn_if_bf16_is_emulated(precision: str) -> None:
    """Print ``bf16_cpu_warning`` for this machine once (rank 0)."""
    cpuinfo = CPUINFO.read_text() if CPUINFO.is_file() else ""
    line = bf16_cpu_warning(precision, get_accelerator().device_name(), cpu_flags(cpuinfo))
    if line and is_rank0():
        print(line, file=sys.stderr, flush=True)
