"""Multi-token prediction (DeepSeek-V3, section 2.2; transformers' ``MtpLayer`` / ``MtpModel``).

Depth k (1..D) predicts the token k + 1 places ahead: at position i it joins the previous depth's hidden state
h^{k-1}_i (depth 0: the main model's final-normed output, as transformers feeds its ``MtpModel``) with the embedding
of token i + k, each RMS-normed (``enorm``, ``hnorm``), concatenated [embedding; hidden] and projected back to
the model width (``eh_proj``), runs one transformer layer (an MoE layer where the model has experts, as
transformers builds them), and normalises the result (``final_norm``: DeepSeek's ``shared_head.norm``,
transformers' ``post_norm``); the main model's embedding and output layer are shared. Positions past the sequence
read a padding token and are not scored, so a depth never sees a token it predicts (the attention is causal).

The training loss adds ``mtp_loss_scaling_factor`` (lambda) x the mean over the depths of each depth's
cross-entropy (DeepSeek-V3's equation 25). Under TP the embedding and the output layer are the vocab-parallel ones
of the main model; ``eh_proj`` is replicated.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import GPTConfig
from .parallel import cp_world_size, vocab_parallel_cross_entropy


class MTPLayer(nn.Module):
    """One depth around ``block`` (a ``models.gpt.TransformerLayer``); ``seed`` draws ``eh_proj``."""

    def __init__(self, config: GPTConfig, block: nn.Module, seed: int):
        super().__init__()
        h = config.hidden_size
        self.enorm = nn.RMSNorm(h, eps=config.norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=config.init_std, generator=torch.Generator().manual_seed(seed))
        self.block = block
        self.final_norm = nn.RMSNorm(h, eps=config.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.final_norm(self.block(self.eh_proj(joined)))


def shifted(ids: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``ids`` [b, s] moved k places left, the last k filled with ``fill``."""
    return torch.cat([ids[:, k:], ids.new_full((ids.shape[0], min(k, ids.shape[1])), fill)], dim=1)


class MultiTokenPrediction(nn.Module):
    """The D depths, each around one of ``blocks``, in order; depth d's ``eh_proj`` drawn from ``seed + 2 d``."""

    def __init__(self, config: GPTConfig, blocks: list[nn.Module], seed: int):
        super().__init__()
        if getattr(config, "sequence_parallel", False) or cp_world_size() > 1:
            raise ValueError("multi-token prediction runs without sequence or context parallelism for now")
        self.layers = nn.ModuleList(MTPLayer(config, block, seed + 2 * d) for d, block in enumerate(blocks))
        self.vocab_size = config.vocab_size

    def hidden_states(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                      embed: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Each depth's final-normed output [b, s, h]; ``hidden`` the main model's, ``embed`` its token embedding.
        Depth k at position i predicts token i + k + 1 (valid where i + k + 1 <= s)."""
        out = []
        for k, layer in enumerate(self.layers, start=1):
            hidden = layer(hidden, embed(shifted(input_ids, k, 0)))
            out.append(hidden)
        return out

    def loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
             embed: Callable[[torch.Tensor], torch.Tensor],
             logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The mean over the depths of their cross-entropies (``labels``: the main model's, shifted already;
        ``logits``: this rank's vocabulary slice of the shared output layer)."""
        losses = [vocab_parallel_cross_entropy(logits(h), shifted(labels, k, -100), vocab_size=self.vocab_size)
                  for k, h in enumerate(self.hidden_states(hidden, input_ids, embed), start=1)]
        return torch.stack(losses).mean()

    def moe_aux_loss(self) -> torch.Tensor | float:
        """The auxiliary losses of the depths' MoE layers from the last forward (0.0: none)."""
        losses = [getattr(layer.block.mlp, "aux_loss", None) for layer in self.layers]
        return sum(loss for loss in losses if loss is not None)
