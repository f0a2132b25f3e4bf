"""The planner's activation terms, generalised to GQA, SwiGLU and dropout off, reduce to Korthikanti et al.
(2022)'s closed forms for the gpt2 layer they describe (per layer, 2-byte activations) when the attention
scores are materialised; a fused attention kernel keeps only its log-sum-exp."""
from dataclasses import replace

import pytest

from models import GPTConfig
from pipeline.planning.memory import layer_activations
from pipeline.families.gpt.shape import gpt_shape


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpt2_layer_matches_the_paper(tp):
    s, b, h, a = 512, 4, 1024, 16
    fused = gpt_shape(GPTConfig(variant="gpt2", hidden_size=h, num_heads=a, num_layers=2, vocab_size=1024,
                                max_position_embeddings=s), "gpt2")
    shape = replace(fused, fused_attention=False)
    sbh = s * b * h
    assert layer_activations(shape, b, tp, False, "none") == pytest.approx(sbh * (10 + 24 / tp + 5 * a * s / (h * tp)))
    assert layer_activations(shape, b, tp, True, "none") == pytest.approx(sbh * (34 / tp + 5 * a * s / (h * tp)))
    assert layer_activations(shape, b, tp, True, "selective") == pytest.approx(sbh * 34 / tp)
    assert layer_activations(shape, b, tp, False, "selective") == pytest.approx(sbh * (10 + 24 / tp))
    assert layer_activations(shape, b, tp, True, "full") == pytest.approx(2 * sbh / tp)
    # selective with mlp_act (the second MLP linear's input, 8sbh/t) and layernorm (the norms' outputs, 4sbh)
    every = ("core_attn", "mlp_act", "layernorm")
    assert layer_activations(shape, b, tp, False, "selective", every) == pytest.approx(sbh * (6 + 16 / tp))
    assert layer_activations(shape, b, tp, True, "selective", every) == pytest.approx(sbh * 22 / tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_attention_keeps_no_scores_so_core_attn_recomputation_saves_only_its_log_sum_exp(tp):
    s, b, h, a = 512, 4, 1024, 16
    fused = gpt_shape(GPTConfig(variant="gpt2", hidden_size=h, num_heads=a, num_layers=2, vocab_size=1024,
                                max_position_embeddings=s), "gpt2")
    assert fused.fused_attention  # the default: the project's SDPA on a GPU
    sbh, lse = s * b * h, 4 * a * s * b / tp
    paper = layer_activations(replace(fused, fused_attention=False), b, tp, False, "selective")
    assert layer_activations(fused, b, tp, False, "none") == pytest.approx(paper + lse)
    assert layer_activations(fused, b, tp, False, "selective") == pytest.approx(sbh * (10 + 24 / tp))
    assert layer_activations(fused, b, tp, True, "full") == pytest.approx(2 * sbh / tp)
