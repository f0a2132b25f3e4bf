"""GPU server profiles (``hardware.json`` beside this module) and the bandwidth a collective gets on them.

A group of ranks that fits in one server talks over NVLink/NVSwitch; one that spans servers is limited by
InfiniBand, shared by every group of the same kind in the server: with ``k`` of a group's members in each
server, ``gpus_per_server / k`` such groups cross the server's adapters at once, so one ring gets
``ib_gbps_per_server * k / gpus_per_server``. NVLink figures are quoted for both directions; a ring sends
one way, so it gets half. Both are then scaled by ``bus_efficiency`` (what a large NCCL collective reaches).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.job.errors import UserError

PROFILES = Path(__file__).with_name("hardware.json")


class HardwareError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Link:
    name: str               # "nvlink" or "ib"
    bytes_per_s: float      # one direction, what one ring of the group gets
    latency_s: float        # per ring step


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    gpus_per_server: int
    nvlink_bytes_per_s: float      # both directions
    ib_bytes_per_s_per_server: float
    sustained_flops: float
    bus_efficiency: float
    latency_s: dict

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "Hardware":
        return cls(name=name, description=d["description"], peak_flops=d["peak_tflops"] * 1e12,
                   hbm_bytes=d["hbm_gib"] * 2**30, hbm_bytes_per_s=d["hbm_gbps"] * 1e9,
                   gpus_per_server=d["gpus_per_server"], nvlink_bytes_per_s=d["nvlink_gbps"] * 1e9,
                   ib_bytes_per_s_per_server=d["ib_gbps_per_server"] * 1e9,
                   sustained_flops=d["sustained_tflops"] * 1e12, bus_efficiency=d["bus_efficiency"],
                   latency_s={k: v * 1e-6 for k, v in d["latency_us"].items()})

    def with_sustained(self, tflops: float | None) -> "Hardware":
        if tflops is None:
            return self
        return Hardware(**{**self.__dict__, "sustained_flops": tflops * 1e12})

    def link(self, group_size: int, stride: int) -> Link:
        """The link of a group of ``group_size`` ranks ``stride`` apart in rank order (TP: stride 1; PP: TP;
        DP: TP x PP), ranks filling servers in order."""
        span = group_size * stride
        if span <= self.gpus_per_server:
            return Link("nvlink", self.nvlink_bytes_per_s / 2 * self.bus_efficiency, self.latency_s["nvlink"])
        members_per_server = max(1, self.gpus_per_server // stride)
        per_ring = self.ib_bytes_per_s_per_server * members_per_server / self.gpus_per_server
        return Link("ib", min(per_ring, self.nvlink_bytes_per_s / 2) * self.bus_efficiency, self.latency_s["ib"])


def profiles() -> dict[str, dict]:
    return {k: v for k, v in json.loads(PROFILES.read_text()).items() if not k.startswith("_")}


def hardware(name: str) -> Hardware:
    known = profiles()
    if name not in known:
        raise HardwareError(f"--hardware {name}: unknown profile; choose one of {', '.join(known)} "
                            f"(or add one to {PROFILES.name})")
    return Hardware.from_dict(name, known[name])
