"""Where a Hugging Face mixture-of-experts family keeps an MoE layer's tensors, in its files and in memory.

The files (what ``save_pretrained`` writes and the Hub holds) have one tensor per expert and projection:
Mixtral's ``model.layers.L.block_sparse_moe.experts.E.w1/w3/w2.weight`` (gate, up, down) and router
``block_sparse_moe.gate.weight``; Qwen3-MoE's, Qwen2-MoE's and DeepSeek-V3's
``model.layers.L.mlp.experts.E.gate_proj/up_proj/down_proj.weight`` and ``mlp.gate.weight``. Beside the routed
experts, DeepSeek-V3 has ``mlp.shared_experts.*_proj`` and the balancing bias ``mlp.gate.e_score_correction_bias``;
Qwen2-MoE ``mlp.shared_expert.*_proj`` and its gate ``mlp.shared_expert_gate.weight``. transformers 5 fuses the
experts in memory only (``mlp.experts.gate_up_proj`` [E, 2f, h], ``mlp.experts.down_proj`` [E, h, f], router
``mlp.gate.weight``) and reverts that on save, so the conversion tables name the files' tensors and
``unfuse_experts`` gives a loaded model's state dict those names.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertNames:
    block: str   # the MoE block under ``model.layers.L.``
    gate: str    # each expert's gate, up and down projections
    up: str
    down: str
    shared: str | None = None       # the shared expert's module under the block (None: the family has none)
    shared_gate: str | None = None  # its sigmoid gate's module (Qwen2-MoE)

    def router(self, layer: str) -> str:
        return f"{layer}{self.block}.gate.weight"

    def router_bias(self, layer: str) -> str:
        """The auxiliary-loss-free balancing bias (DeepSeek-V3's ``e_score_correction_bias``)."""
        return f"{layer}{self.block}.gate.e_score_correction_bias"

    def shared_expert(self, layer: str) -> tuple[str, str, str]:
        """(gate, up, down) weight names of the shared expert."""
        x = f"{layer}{self.block}.{self.shared}."
        return x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"

    def shared_expert_gate(self, layer: str) -> str:
        return f"{layer}{self.block}.{self.shared_gate}.weight"

    def expert(self, layer: str, e: int) -> tuple[str, str, str]:
        """(gate, up, down) weight names of expert ``e`` of the layer whose names start with ``layer``."""
        x = f"{layer}{self.block}.experts.{e}."
        return x + f"{self.gate}.weight", x + f"{self.up}.weight", x + f"{self.down}.weight"


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN3_MOE_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
QWEN2_MOE_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "shared_expert", "shared_expert_gate")
DEEPSEEK_V3_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "shared_experts")


def is_fused(hf_sd: Mapping) -> bool:
    """Whether ``hf_sd`` is a loaded transformers 5 MoE's state dict (experts fused)."""
    return any(k.endswith(".mlp.experts.gate_up_proj") for k in hf_sd)


def unfuse_experts(hf_sd: Mapping, names: ExpertNames) -> dict:
    """A loaded transformers 5 MoE's state dict with the names and per-expert tensors of its files (views)."""
    out = {}
    for name, value in hf_sd.items():
        head, sep, leaf = name.partition(".mlp.")
        layer = head + "."
        if sep and leaf == "gate.weight":
            out[names.router(layer)] = value
        elif sep and leaf == "experts.gate_up_proj":
            for e, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                gate_name, up_name, _ = names.expert(layer, e)
                out[gate_name], out[up_name] = gate, up
        elif sep and leaf == "experts.down_proj":
            for e, w in enumerate(value):
                out[names.expert(layer, e)[2]] = w
        else:
            out[name] = value
    return out
