"""Selective recomputation of the MLP activation and the norms (``--recompute-modules``): what one layer no longer
keeps, counted by bench/activation_memory.py's census of autograd's saved tensors (fp32, one process), is the
planner's ``recompute_savings`` (Korthikanti et al. 2022's terms); the gradients are unchanged. (The losses at TP2
with and without dropout: tests/pipeline/engine/test_engine.py.)"""
import sys

import pytest
import torch

from conftest import ROOT
from models import GPT, GPTConfig
from models.gpt import select_recompute_modules
from pipeline.job.errors import UserError
from pipeline.pretrain import parse_args
from pipeline.planning.memory import recompute_savings
from pipeline.families.gpt.shape import gpt_shape

sys.path.insert(0, str(ROOT / "bench"))
from activation_memory import SavedTensorCensus, _param_storages  # noqa: E402

S, B, H = 64, 2, 64
CONFIG = dict(variant="gpt2", vocab_size=256, hidden_size=H, num_layers=1, num_heads=4, max_position_embeddings=S,
              hidden_dropout=0.0, attention_dropout=0.0)


def _checkpoint(fn, *args):  # the reentrant checkpoint saves its inputs where the census sees them
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)


def _layer(modules, config=CONFIG):
    model = GPT(GPTConfig(**config), init_seed=0).train()
    select_recompute_modules(model, _checkpoint, modules)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with SavedTensorCensus(_param_storages(model)) as census:
        y = model.layers[0](x)
    (y * y).sum().backward()
    return census.bytes, [x.grad] + [p.grad for p in model.layers[0].parameters()]


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("modules", [("mlp_act",), ("mlp",), ("layernorm",), ("mlp_act", "layernorm"),
                                     ("mlp", "layernorm")])
def test_each_module_saves_what_the_formula_says(modules, variant):
    config = {**CONFIG, "variant": variant}
    kept, grads = _layer((), config)
    recomputed, grads_recomputed = _layer(modules, config)
    formula = 2 * recompute_savings(gpt_shape(GPTConfig(**config), seq=S), B, 1, False, modules)  # fp32: 2x
    print(f"{variant} {modules}: {kept - recomputed} bytes fewer, formula {formula:.0f}")
    if variant == "gpt2":
        assert kept - recomputed == pytest.approx(formula, rel=0.05)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputed))
    else:  # unfused SwiGLU and RMSNorm keep intermediates too (silu(gate), x * rsqrt): recomputing frees them also
        assert formula <= kept - recomputed <= 2.1 * formula
        # the recomputed RMSNorm sums its input gradient in another order (~1e-6 on gradients of ~4)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(grads, grads_recomputed))


def test_moe_act_frees_every_experts_activation():
    """Megatron-Core's moe_act: each expert's GELU output (fc_out's input), k routes a token, dropless."""
    moe = {**CONFIG, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32}
    kept, grads = _layer((), moe)
    recomputed, grads_recomputed = _layer(("moe_act",), moe)
    formula = B * S * 2 * 32 * 4  # tokens x k routes x the expert's ffn, fp32
    print(f"moe_act: {kept - recomputed} bytes fewer, formula {formula}")
    assert kept - recomputed == pytest.approx(formula, rel=0.05)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputed))


def test_recompute_modules_flag():
    assert parse_args(["--recompute", "selective"]).recompute_modules == ("core_attn",)
    args = parse_args(["--recompute", "selective", "--recompute-modules", "layernorm,core_attn,mlp_act"])
    assert args.recompute_modules == ("core_attn", "mlp_act", "layernorm")
    with pytest.raises(UserError, match="--recompute-modules: applies to --recompute selective, not none; add"):
        parse_args(["--recompute-modules", "mlp_act"])
    with pytest.raises(UserError, match="mlp recomputes the whole MLP, mlp_act included; name one of them"):
        parse_args(["--recompute", "selective", "--recompute-modules", "mlp,mlp_act"])
    with pytest.raises(UserError, match="unknown 'norm' module; give a comma list of core_attn, mlp_act, mlp, "
                                        "moe_act, layernorm"):
        parse_args(["--recompute", "selective", "--recompute-modules", "core_attn,norm"])
