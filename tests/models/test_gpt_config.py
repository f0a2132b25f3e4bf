"""Model config validation: every bad config names what is wrong."""
import json

import pytest
import torch

from models import GPT, ConfigError, GPTConfig

BASE = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16)


@pytest.mark.parametrize("override,message", [
    (dict(hidden_size=30), "hidden_size 30 is not divisible by num_heads 4"),
    (dict(variant="bert"), "unknown variant 'bert'"),
    (dict(seq_length=32), "seq_length 32 is longer than max_position_embeddings 16"),
    (dict(variant="llama", num_kv_heads=3), "num_heads 4 is not divisible by num_kv_heads 3"),
    (dict(variant="gpt2", num_kv_heads=2), "grouped-query attention"),
    (dict(variant="gpt2", tie_embeddings=False), "ties its input and output embeddings"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(hidden_dropout=1.5), "hidden_dropout must be in [0, 1)"),
])
def test_bad_config_messages(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        GPTConfig(**{**BASE, **override})
    assert message in str(e.value)


@pytest.mark.parametrize("override,tp,message", [
    (dict(num_heads=4, hidden_size=32), 3, "num_heads 4 is not divisible by the tensor-parallel size 3"),
    (dict(variant="llama", num_heads=8, num_kv_heads=2), 4, "num_kv_heads 2 is not divisible by the tensor-parallel size 4"),
])
def test_tensor_parallel_divisibility(override, tp, message):
    with pytest.raises(ConfigError) as e:
        GPTConfig(**{**BASE, **override}).check_parallel(tp)
    assert message in str(e.value)


def test_pipeline_deeper_than_model():
    with pytest.raises(ConfigError, match="pipeline_parallel=3 is more than num_layers 2"):
        GPTConfig(**BASE).check_parallel(1, 3)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text('{"hidden_size": 32,\n "num_layrs": 2}')
    with pytest.raises(ConfigError, match=r"m.json: unknown field\(s\) num_layrs"):
        GPTConfig.from_file(bad)
    bad.write_text('{"hidden_size": 32,\n "num_layers": 2,}')
    with pytest.raises(ConfigError, match=r"m.json: invalid JSON at line 2"):
        GPTConfig.from_file(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        GPTConfig.from_file(tmp_path / "missing.json")


def test_roundtrip_and_parameter_count(tmp_path):
    for variant in ("gpt2", "llama"):
        cfg = GPTConfig(**BASE, variant=variant, tie_embeddings=variant == "gpt2", make_vocab_size_divisible_by=1)
        path = tmp_path / f"{variant}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        assert GPTConfig.from_file(path) == cfg
        model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_sequence_longer_than_positions_at_forward():
    model = GPT(GPTConfig(**BASE))
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than max_position_embeddings 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_llama_options_count_validate_and_limit_the_sequence():
    for options in (dict(qkv_bias=True), dict(qk_norm=True, head_dim=12), dict(sliding_window=16)):
        cfg = GPTConfig(**BASE, variant="llama", num_kv_heads=2, make_vocab_size_divisible_by=1, **options)
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_parameters(), options
    with pytest.raises(ConfigError, match="qk_norm is an option of the llama variant, not of gpt2"):
        GPTConfig(**BASE, qk_norm=True)
    with pytest.raises(ConfigError, match="sliding_window 8 is shorter than seq_length 16"):
        GPTConfig(**BASE, variant="llama", sliding_window=8)
    model = GPT(GPTConfig(**BASE, variant="llama", seq_length=8, sliding_window=12))
    assert model.config.max_sequence_length == 12
    with pytest.raises(ValueError, match=r"sequence of 13 tokens is longer than sliding_window 12 \(full causal"):
        model(torch.zeros(1, 13, dtype=torch.long))
