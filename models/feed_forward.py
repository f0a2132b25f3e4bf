"""The feed-forward block every MLP of the project shares, dense or expert: ``fc_in`` -> activation -> ``fc_out``,
GELU-tanh (gpt2) or SwiGLU's silu(gate) * up with ``fc_in`` holding [gate; up] (llama).

``recompute_act`` (Megatron-Core's ``mlp_act`` for the dense MLP, ``moe_act`` for the experts): the activation's
output, ``fc_out``'s input, is freed once ``fc_out`` has saved it and rebuilt from ``fc_in``'s kept output when
``fc_out``'s output gradient arrives (models/recompute.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import DiscardedOutput, compiled_recompute


class FeedForward(nn.Module):
    """Subclasses set ``fc_in`` and ``fc_out`` (tensor-parallel linears) after ``super().__init__(gated)``."""

    def __init__(self, gated: bool):
        super().__init__()
        self.gated = gated
        self.recompute_act = False  # selective recomputation of the activation (select_recompute_modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_act and self.training and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                return self.fc_out(compiled_recompute(self._activation, self.fc_in(x)))
            h = DiscardedOutput(self._activation, self.fc_in(x))  # keeps fc_in's output, not the activation's
            y = self.fc_out(h.output)
            h.discard(y)
            return y
        return self._compute(x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self._activation(self.fc_in(x)))

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")
