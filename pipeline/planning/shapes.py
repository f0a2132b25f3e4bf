"""What the planner needs of a model: its parameters by where they live and its FLOPs per token (``ModelShape``).

Each family builds its own from its config class (``ModelFamily.shape``: ``pipeline/families/<family>/shape.py``),
so that a preset or a JSON file plans exactly what ``pipeline.pretrain`` would build (the vocabulary padded as the
model pads it).
"""
from __future__ import annotations

from dataclasses import dataclass

def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ModelShape:
    name: str
    recurrent: bool           # a recurrent model (the mLSTM): no TP or PP, no attention, per-step activations
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int                # padded, as the model allocates it
    seq: int
    gated_mlp: bool           # SwiGLU (llama): three matrices, two [s, b, f] inputs saved
    hidden_dropout: bool
    attention_dropout: bool
    layer_params: int         # one transformer layer (or one mLSTM layer)
    embedding_params: int     # the input side: token (and position) embeddings
    head_params: int          # the output layer when it is not tied (else 0), final norm included
    flops_per_token: float    # training, forward + backward, no recomputation (PaLM's count)
    attention_flops_per_token: float  # of which the scores and values (recomputed by the selective policy)
    replicated_per_layer: tuple = ()  # element counts of a layer's parameters replicated across TP (norms, biases)
    replicated_outside: tuple = ()    # the same outside the layers (final norm, gpt2's positions)
    # the attention runs in a fused kernel (the project's SDPA on a GPU: flash or memory-efficient), which
    # keeps no [s, s] scores, only a row's fp32 log-sum-exp, and regenerates its dropout mask; False: the
    # scores are materialised (Megatron-LM 2019, Korthikanti's accounting, SDPA's math path on a CPU)
    fused_attention: bool = True

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    @property
    def tied(self) -> bool:
        return self.head_params < self.hidden * self.vocab

    def stage_params(self, tp: int, pp: int, stage: str | None = None) -> float:
        """Parameters on one GPU of a pipeline stage: ``"first"``, ``"last"``, or (None) the fullest. TP splits
        the matrices and the vocabulary; the norms, row-parallel biases and positions stay whole on every TP
        rank (what each rank's optimizer and DP collectives hold). The last stage of a tied model keeps its own
        copy of the embedding (DeepSpeed's TiedLayerSpec, positions included)."""
        rep = sum(self.replicated_per_layer)
        per_stage = -(-self.layers // pp) * ((self.layer_params - rep) / tp + rep)
        if self.recurrent:  # the mLSTM: one GPU holds it all (no TP or PP)
            return per_stage + self.embedding_params + self.head_params
        words = self.hidden * self.vocab
        positions = self.embedding_params - words
        embedding = words / tp + positions
        norm = self.head_params - (0 if self.tied else words)  # the final norm, whole on every rank
        output = embedding if self.tied else words / tp         # the tied copy, or the output layer's shard
        if pp == 1:
            return per_stage + embedding + norm + (0 if self.tied else output)
        sizes = {"first": per_stage + embedding, "last": per_stage + norm + output}
        return sizes[stage] if stage else max(sizes.values())
