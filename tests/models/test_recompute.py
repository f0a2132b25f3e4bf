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
from pipeline.planning.shapes import gpt_shape

sys.path.insert(0, str(ROOT / "bench"))
from activation_memory import SavedTensorCensus, _param_storages  # noqa: E402

S, B, H = 64, 2, 64
CONFIG = dict(variant="gpt2", vocab_size=256, hidden_size=H, num_layers=1, num_heads=4, max_position_embeddings=S,
              hidden_dropout=0.0, attention_dropout=0.0)


def _layer(modules):
    model = GPT(GPTConfig(**CONFIG), init_seed=0).train()
    select_recompute_modules(model, None, modules)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with SavedTensorCensus(_param_storages(model)) as census:
        y = model.layers[0](x)
    (y * y).sum().backward()
    return census.bytes, [x.grad] + [p.grad for p in model.layers[0].parameters()]


@pytest.mark.parametrize("modules", [("mlp_act",), ("layernorm",), ("mlp_act", "layernorm")])
def test_each_module_saves_what_the_formula_says(modules):
    kept, grads = _layer(())
    recomputed, grads_recomputed = _layer(modules)
    formula = 2 * recompute_savings(gpt_shape(GPTConfig(**CONFIG), seq=S), B, 1, False, modules)  # fp32: 2x
    print(f"{modules}: {kept - recomputed} bytes fewer, formula {formula:.0f}")
    assert kept - recomputed == pytest.approx(formula, rel=0.05)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputed))


def test_recompute_modules_flag():
    assert parse_args(["--recompute", "selective"]).recompute_modules == ("core_attn",)
    args = parse_args(["--recompute", "selective", "--recompute-modules", "layernorm,core_attn,mlp_act"])
    assert args.recompute_modules == ("core_attn", "mlp_act", "layernorm")
    with pytest.raises(UserError, match="--recompute-modules: applies to --recompute selective, not none; add"):
        parse_args(["--recompute-modules", "mlp_act"])
    with pytest.raises(UserError, match="unknown 'norm' module; give a comma list of core_attn, mlp_act, layernorm"):
        parse_args(["--recompute", "selective", "--recompute-modules", "core_attn,norm"])
