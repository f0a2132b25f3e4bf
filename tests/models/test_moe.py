"""MoE GPT (models/moe/): a tiny random transformers Mixtral imported through pipeline/hf/convert.py gives
transformers' logits (fp32, dropless, one process); the routing and aux loss against hand computations."""
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from models.config import GPTConfig
from models.gpt import GPT
from models.moe import route
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import from_hf


def _mixtral(top_k=2):
    torch.manual_seed(0)
    c = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=top_k,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return MixtralForCausalLM(c).eval()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_imported_mixtral_logits_equal_transformers(top_k):
    hf = _mixtral(top_k)
    config, sd = from_hf(hf)
    assert (config.num_experts, config.moe_top_k, config.hf_model_type) == (4, top_k, "mixtral")
    model = GPT(config, init_seed=1).eval()
    load_full_state_dict(model, sd)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref, ours = hf(ids).logits, model(ids)
    assert ref.abs().max() > 0.01
    assert (ref - ours).abs().max() < 1e-5


def test_route_renormalises_and_aux_loss_is_mixtrals():
    logits = torch.randn(10, 4)
    w, e, loc, kept, cap, l_aux, _, counts = route(logits, 2, True, None, 4)
    p = logits.softmax(-1)
    top, idx = p.topk(2, -1)
    assert torch.allclose(w, top / top.sum(-1, keepdim=True)) and torch.equal(e, idx) and bool(kept.all())
    mask = torch.nn.functional.one_hot(idx, 4).float()      # Mixtral's load_balancing_loss_func by hand
    expected = 4 * (mask.mean(0) * p.mean(0)[None]).sum()
    assert torch.allclose(l_aux, expected) and int(counts.sum()) == 20 and cap == int(counts.max())
    _, _, _, kept, cap, *_ = route(logits, 2, True, 0.5, 1)  # capacity 3 per expert: some routes dropped
    assert cap == 3 and not bool(kept.all())


def test_aux_loss_reaches_the_training_loss():
    config = GPTConfig(variant="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=32,
                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, num_experts=4,
                       moe_aux_loss_coeff=0.5, moe_layer_freq=2)
    model = GPT(config, init_seed=0)
    assert sum(1 for layer in model.layers if hasattr(layer.mlp, "moe")) == 1
    ids = torch.randint(0, 64, (2, 9))
    loss = model(ids[:, :-1], ids[:, 1:])
    model.eval()
    ce = model(ids[:, :-1], ids[:, 1:])
    assert torch.allclose(loss - ce, model.moe_aux_loss()) and float(loss - ce) > 0.4  # l_aux >= 1 for uniform


def test_flops_count_the_active_parameters():
    """Of an MoE layer the FLOPs count the router and the top-k experts (4 experts, top-2, every other layer MoE):
    6 x (the dense SwiGLU's 3 h f weights - (k x 3 h f_expert + h E)) fewer than the dense model's."""
    dense = dict(variant="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48,
                 max_position_embeddings=16)
    moe = GPTConfig(**dense, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_layer_freq=2)
    diff = GPTConfig(**dense).flops_per_token(16) - moe.flops_per_token(16)
    assert diff == 6 * (3 * 32 * 48 - (2 * 3 * 32 * 16 + 32 * 4))
