"""The GPT's shape for the planner (``pipeline.planning``): its parameters by where they live and its FLOPs per
token, from its config (the vocabulary padded as the model pads it)."""
from __future__ import annotations

from models import GPTConfig
from pipeline.planning.shapes import ModelShape, padded


def gpt_shape(c: GPTConfig, name: str = "gpt", seq: int | None = None) -> ModelShape:
    s = seq or c.seq_length
    vocab = padded(c.vocab_size, c.make_vocab_size_divisible_by)
    q = c.num_heads * c.head_dim
    full = c.num_parameters()
    positions = c.max_position_embeddings * c.hidden_size if c.learned_positions else 0
    norm_tensors = 2 if c.norm_has_bias else 1  # a LayerNorm's weight and bias, an RMSNorm's weight
    embedding = vocab * c.hidden_size + positions
    final_norm = norm_tensors * c.hidden_size
    head = (0 if c.tie_embeddings else vocab * c.hidden_size) + final_norm
    unpadded_rest = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    layer = (full - unpadded_rest - positions - final_norm) // c.num_layers
    return ModelShape(
        name=name, recurrent=False, hidden=c.hidden_size, layers=c.num_layers, heads=c.num_heads,
        kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn=c.ffn_hidden_size, vocab=vocab, seq=s,
        gated_mlp=c.gated_mlp, hidden_dropout=c.hidden_dropout > 0,
        attention_dropout=c.attention_dropout > 0, layer_params=layer, embedding_params=embedding,
        head_params=head, flops_per_token=c.flops_per_token(s),
        attention_flops_per_token=12.0 * c.num_layers * q * s,
        # a layer's two norms and its row-parallel biases (attention's dense, the MLP's fc_out)
        replicated_per_layer=(c.hidden_size,) * (2 * norm_tensors + (2 if c.bias else 0)),
        replicated_outside=(c.hidden_size,) * norm_tensors + ((positions,) if positions else ()))
