"""The model-family registry: every entry names what every command asks of it, and refuses layouts by name."""
import pytest

from pipeline.job.layout import LayoutError
from models import GPTConfig, MLSTMConfig
from models.config import ConfigError
from pipeline.job.families import FAMILIES, family_named, family_of, family_of_dict

REQUIRED = ("hf_exporter", "hf_verifier", "scorer", "encoder")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_holds_everything_the_commands_ask_for(name):
    family = family_named(name)
    assert set(REQUIRED) <= set(family.parts())
    for what in family.parts():  # the optional ones too (the decoder)
        assert callable(family.get(what)) and family.get(what) is getattr(family, what), what
    assert family.get("encoder").default_pooling in ("last", "none")
    assert family_of_dict({"model_type": name}) is family


def test_a_part_a_family_lacks_is_refused_by_name():
    family = family_named("mlstm")
    with pytest.raises(ConfigError, match="the mlstm model family has no hf classifier; it has hf_exporter"):
        family.get("hf_classifier")
    assert family_named("gpt").hf_sequence_classification and not family.hf_sequence_classification


def test_family_of_a_config_and_the_layouts_it_refuses():
    gpt = GPTConfig(variant="gpt2", hidden_size=32, num_layers=2, num_heads=4, vocab_size=64,
                    max_position_embeddings=16)
    mlstm = MLSTMConfig(vocab_size=64, embed_dim=8, hidden_size=16, seq_length=8)
    assert family_of(gpt).name == "gpt" and family_of(mlstm).name == "mlstm"
    family_of(gpt).check_layout(gpt, 2, 2)
    with pytest.raises(LayoutError, match="num_heads 4 is not divisible by the tensor-parallel size 3"):
        family_of(gpt).check_layout(gpt, 3, 1)
    with pytest.raises(LayoutError, match="--tensor-parallel 2 with the mlstm model: it trains with data parallelism"):
        family_of(mlstm).check_layout(mlstm, 2, 1)
    specs = family_of(mlstm).shard_specs(mlstm)
    assert specs and all(spec is None for spec in specs.values())
    assert any(spec is not None for spec in family_of(gpt).shard_specs(gpt).values())
    with pytest.raises(ConfigError, match="unknown model_type 'rnn'; known: gpt, mlstm"):
        family_of_dict({"model_type": "rnn"}, "x.json")
