"""Short causal attention on a CPU runs as plain matrix products (models.gpt.short_causal_attention): the same
result as PyTorch's SDPA, grouped-query heads included, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from models import GPTConfig
from models.gpt import SHORT_CPU_ATTENTION, Attention, short_causal_attention
from models.parallel import Layout, initialize_model_parallel


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_equals_sdpa_forward_and_backward_in_fp32(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, 37, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, 37, 16, generator=g, requires_grad=True) for _ in range(2))
    ours = short_causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    assert (ours - ref).abs().max() < 1e-5
    grad = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert (a - b).abs().max() < 1e-5


def test_bf16_rounds_like_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 50, 32, generator=g).bfloat16() for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    ours = short_causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= (ref.double() - exact).abs().max() * 1.01 + 1e-12


@pytest.mark.parametrize("seq", [SHORT_CPU_ATTENTION, SHORT_CPU_ATTENTION + 1])
def test_the_layer_gives_sdpa_result_on_both_sides_of_the_threshold(seq, monkeypatch):
    initialize_model_parallel(1, 1)
    config = GPTConfig(variant="llama", hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=1, vocab_size=128,
                       max_position_embeddings=256, attention_dropout=0.0, hidden_dropout=0.0)
    layer = Attention(config, Layout()).eval()
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, seq, 16, generator=g), torch.randn(2, 2, seq, 16, generator=g), torch.randn(2, 2, seq, 16, generator=g)
    used = []
    monkeypatch.setattr("models.gpt.short_causal_attention",
                        lambda *a: used.append(True) or short_causal_attention(*a))
    out = layer._core(q, k, v)
    assert bool(used) == (seq <= SHORT_CPU_ATTENTION)
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)).abs().max() < 1e-5
