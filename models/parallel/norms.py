"""LayerNorm and RMSNorm for the sequence-split region of sequence parallelism.

Each rank normalises its own chunk of the sequence; the weights (and bias) are
replicated and see only that chunk, so their gradients are summed over the TP
group (``sequence_parallel_parameter``). The parameter names are those of
``torch.nn.LayerNorm`` / ``RMSNorm``, so state dicts do not change.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .mappings import sequence_parallel_parameter
from .sharding import mark_sequence_parallel


def _sp(param):
    return None if param is None else sequence_parallel_parameter(param)


class SequenceParallelLayerNorm(nn.LayerNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            mark_sequence_parallel(p)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, _sp(self.weight), _sp(self.bias), self.eps)


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm over ``head_dim`` on each of this rank's attention heads (Qwen3's Q/K norm). The weight is
    replicated (no ShardSpec: checkpoints and resharding keep one copy), but each TP rank's gradient comes
    from its own heads only, so it is summed over the TP group like a sequence-parallel norm's."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, _sp(self.weight), self.eps)


class SequenceParallelRMSNorm(HeadRMSNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            mark_sequence_parallel(p)
