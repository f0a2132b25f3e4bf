"""The mLSTM's shape for the planner (``pipeline.planning``): one recurrent model on one GPU, its parameters and
FLOPs per token."""
from __future__ import annotations

from models import MLSTMConfig
from pipeline.planning.shapes import ModelShape


def mlstm_shape(c: MLSTMConfig, name: str = "mlstm", seq: int | None = None) -> ModelShape:
    full = c.num_parameters()
    head = c.hidden_size * c.vocab_size + c.vocab_size
    embedding = c.vocab_size * c.embed_dim
    return ModelShape(
        name=name, recurrent=True, hidden=c.hidden_size, layers=c.num_layers, heads=1, kv_heads=1,
        head_dim=c.hidden_size, ffn=0, vocab=c.vocab_size, seq=seq or c.seq_length, gated_mlp=False,
        hidden_dropout=c.dropout > 0, attention_dropout=False,
        layer_params=(full - head - embedding) // c.num_layers, embedding_params=embedding, head_params=head,
        flops_per_token=c.flops_per_token(), attention_flops_per_token=0.0)

