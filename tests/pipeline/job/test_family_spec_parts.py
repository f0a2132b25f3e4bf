"""What code outside models/ asks of a GPT config (what its variant builds) agrees with the model it builds, and the
family spec's pipeline names map every parameter of the full model to the pipeline's and back; each family's parts
live in its folder."""
import re

import pytest
import torch

from models import GPT, GPTConfig
from models.parallel import get_shard_spec
from pipeline.job.families import FAMILIES, PARTS, ModelFamily, family_named, family_of

TINY = dict(hidden_size=32, num_layers=3, num_heads=4, vocab_size=64, max_position_embeddings=16)
CONFIGS = {"gpt2": GPTConfig(variant="gpt2", **TINY),
           "llama": GPTConfig(variant="llama", num_kv_heads=2, ffn_hidden_size=64, tie_embeddings=False, **TINY),
           "llama-tied-moe": GPTConfig(variant="llama", num_experts=2, moe_top_k=1, ffn_hidden_size=64, **TINY)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_what_the_config_says_its_variant_builds_is_what_the_model_holds(name):
    config = CONFIGS[name]
    with torch.device("meta"):
        model = GPT(config, init_seed=0)
    params = dict(model.named_parameters())
    assert ("embedding.position_embeddings.weight" in params) == config.learned_positions
    assert ("final_norm.norm.bias" in params) == config.norm_has_bias
    assert ("layers.0.input_norm.bias" in params) == config.norm_has_bias
    fc_in = [p for n, p in params.items() if n.endswith("fc_in.weight")]  # dense or an expert's
    assert fc_in and all(len(get_shard_spec(p).parts) == config.fc_in_parts for p in fc_in), name
    assert config.gated_mlp == (config.fc_in_parts == 2)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pipeline_names_map_every_parameter_there_and_back(name):
    config = CONFIGS[name]
    family = family_of(config)
    names = family.pipeline_names
    full = [n for n, _ in family.meta_model(config).named_parameters()]
    pipe = [names.to_pipeline(n, config) for n in full]
    assert len(set(pipe)) == len(full)  # no two parameters under one pipeline name
    assert [names.from_pipeline(n, config) for n in pipe] == full
    tied = [n for n in pipe if any(re.match(p, n) for p in names.first_stage_copies)]
    assert bool(tied) == config.tie_embeddings  # the tied embedding, which two stages hold


def test_a_family_trained_with_stages_needs_its_pipeline_names():
    gpt = family_named("gpt")
    fields = {f: getattr(gpt, f) for f in gpt.__dataclass_fields__}
    with pytest.raises(ValueError, match="trains with pipeline stages: give it pipeline_names"):
        ModelFamily(**{**fields, "name": "other", "pipeline_names": None})
    assert family_named("mlstm").pipeline_names is None and not family_named("mlstm").pipeline_parallel_capable


def test_each_family_is_one_folder():
    """Every part a registered family holds (its builder, scorer, decoder, encoder, HF exporter and verifier) is
    defined in its own folder, pipeline/families/<family>/: adding a family is that folder, its model in models/,
    and one register line."""
    for family in FAMILIES.values():
        parts = {what: family.get(what) for what in family.parts()} | {"build_module": family.build_module}
        assert set(PARTS) <= set(parts), family.name
        elsewhere = {what: part.__module__ for what, part in parts.items()
                     if not part.__module__.startswith(f"pipeline.families.{family.name}.")
                     and part.__module__ != f"pipeline.families.{family.name}"}
        assert not elsewhere, (family.name, elsewhere)
