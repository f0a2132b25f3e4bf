"""The weight map between the project's GPT and Hugging Face's, in memory: exact both ways, strict, and refusing
what it cannot represent. (Export and import through files and at TP=2: test_hf_export.py, test_hf_import.py.)"""
import pytest
import torch
from transformers import AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig

from models import GPT, GPTConfig
from models.parallel import full_state_dict
from pipeline.hf.convert import (HF_FAMILIES, ConversionError, config_from_hf, from_hf, state_dict_from_hf, to_hf,
                                 weight_map)
from pipeline.checkpoints.state_dicts import StateDictError, load_full_state_dict, read_state_dict, save_state_dict

TINY = dict(vocab_size=101, hidden_size=32, num_layers=2, max_position_embeddings=16, make_vocab_size_divisible_by=8)
CONFIGS = {
    "gpt2": dict(variant="gpt2", num_heads=4, **TINY),
    "gpt2-nobias": dict(variant="gpt2", num_heads=4, bias=False, ffn_hidden_size=40, **TINY),
    "llama-gqa-untied": dict(variant="llama", num_heads=8, num_kv_heads=4, ffn_hidden_size=48, tie_embeddings=False,
                             rope_theta=5000.0, **TINY),
    "llama-tied-bias-headdim": dict(variant="llama", num_heads=4, num_kv_heads=2, head_dim=12, ffn_hidden_size=40,
                                    bias=True, **TINY),
    "qwen2": dict(variant="llama", num_heads=4, num_kv_heads=2, ffn_hidden_size=40, qkv_bias=True, **TINY),
    "qwen3": dict(variant="llama", num_heads=4, num_kv_heads=2, head_dim=12, ffn_hidden_size=40, qk_norm=True,
                  tie_embeddings=False, **TINY),
    "mistral": dict(variant="llama", num_heads=4, num_kv_heads=2, ffn_hidden_size=40, sliding_window=16,
                    tie_embeddings=False, **TINY),
}


def _model(name, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CONFIGS[name])).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a swapped weight/bias
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.normal_(1.0 if "norm" in pname and pname.endswith(".weight") else 0.0, 0.3)
    return model


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", CONFIGS)
def test_weight_map_lists_exactly_the_models_tensors(name):
    model = _model(name)
    sd = full_state_dict(model)
    table = {r.ours: r.shape for r in weight_map(model.config)}
    assert table == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_in_memory_round_trip_and_hf_logits(name):
    model = _model(name)
    sd = full_state_dict(model)
    hf_cfg, hf_sd = to_hf(sd, model.config)
    hf = AutoModelForCausalLM.from_config(hf_cfg).eval()
    result = hf.load_state_dict(hf_sd, strict=False)
    # transformers ties lm_head itself; nothing else may be missing or left over
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    if model.config.tie_embeddings:
        hf.tie_weights()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = _max_rel(hf(ids).logits, model(ids))
    print(f"{name}: max relative logit difference {diff:.2e}")
    assert diff < 1e-5

    config2, sd2 = from_hf(hf)
    assert sd2.keys() == sd.keys()
    for k in sd:
        assert torch.equal(sd2[k], sd[k]), k
    # the import records where it came from: extra, and the Hugging Face family it exports as again
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("extra", "hf_model_type")}  # noqa: E731
    assert strip(config2) == strip(model.config)
    assert config2.extra["hf"]["architecture"] == type(hf).__name__
    assert HF_FAMILIES[config2.hf_model_type].architecture == type(hf).__name__


def test_mapping_error_would_be_caught():
    """Guard for the tests above: K and V swapped in the map changes the logits far beyond the tolerance."""
    model = _model("llama-tied-bias-headdim")
    hf_cfg, hf_sd = to_hf(full_state_dict(model), model.config)
    hf_sd["model.layers.0.self_attn.k_proj.weight"], hf_sd["model.layers.0.self_attn.v_proj.weight"] = (
        hf_sd["model.layers.0.self_attn.v_proj.weight"], hf_sd["model.layers.0.self_attn.k_proj.weight"])
    hf = AutoModelForCausalLM.from_config(hf_cfg).eval()
    hf.load_state_dict(hf_sd, strict=False)
    hf.tie_weights()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_rel(hf(ids).logits, model(ids)) > 1e-2


def test_half_precision_export_and_overflow_refusal():
    model = _model("gpt2")
    sd = full_state_dict(model)
    cfg, hf_sd = to_hf(sd, model.config, dtype="bf16")
    assert cfg.dtype == torch.bfloat16 and {t.dtype for t in hf_sd.values()} == {torch.bfloat16}
    sd["layers.1.mlp.fc_out.weight"][0, 0] = 1e6
    with pytest.raises(ConversionError, match=r"layers\.1\.mlp\.fc_out\.weight has values up to 1e\+06.*float16"):
        to_hf(sd, model.config, dtype="float16")


def test_bad_project_state_dict_names_the_key():
    model = _model("llama-gqa-untied")
    sd = full_state_dict(model)
    sd.pop("layers.1.mlp.fc_out.weight")
    with pytest.raises(ConversionError, match=r"missing: layers\.1\.mlp\.fc_out\.weight"):
        to_hf(sd, model.config)
    sd = full_state_dict(model)
    sd["layers.0.attention.qkv.weight"] = sd["layers.0.attention.qkv.weight"][:-4]
    with pytest.raises(ConversionError, match=r"layers\.0\.attention\.qkv\.weight has shape \(60, 32\), "
                                              r"the config expects \(64, 32\)"):
        to_hf(sd, model.config)


def test_bad_hf_state_dict_names_the_tensor():
    model = _model("gpt2")
    hf_cfg, hf_sd = to_hf(full_state_dict(model), model.config)
    config = config_from_hf(hf_cfg)
    extra = dict(hf_sd, **{"transformer.h.0.attn.c_attn.extra": torch.zeros(1)})
    with pytest.raises(ConversionError, match=r"no place for: transformer\.h\.0\.attn\.c_attn\.extra"):
        state_dict_from_hf(extra, config)
    short = dict(hf_sd)
    short["transformer.h.1.mlp.c_fc.weight"] = short["transformer.h.1.mlp.c_fc.weight"].t()
    with pytest.raises(ConversionError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight \(128, 32\) do\(es\) not fit"):
        state_dict_from_hf(short, config)


@pytest.mark.parametrize("hf_cfg, message", [
    (GemmaConfig(hidden_size=32, num_attention_heads=4, architectures=["GemmaForCausalLM"]),
     r"model_type 'gemma' \(GemmaForCausalLM\) is not supported; supported: GPT2LMHeadModel .*MistralForCausalLM"),
    (GPT2Config(n_embd=32, n_head=4, architectures=["GPT2ForSequenceClassification"]),
     r"architecture GPT2ForSequenceClassification is not supported"),
    (GPT2Config(n_embd=32, n_head=4, activation_function="gelu"),
     r"activation_function='gelu' cannot be represented .*gelu_new"),
    (LlamaConfig(hidden_size=32, num_attention_heads=4,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     r"rope_type='llama3' cannot be represented .*rope_type 'default'"),
    (LlamaConfig(hidden_size=32, num_attention_heads=4, hidden_act="gelu"), r"hidden_act='gelu' cannot be represented"),
    (LlamaConfig(hidden_size=32, num_attention_heads=4, attention_bias=True, mlp_bias=False),
     r"attention_bias/mlp_bias=\(True, False\)"),
])
def test_unrepresentable_hf_configs_are_refused(hf_cfg, message):
    with pytest.raises(ConversionError, match=message):
        config_from_hf(hf_cfg, "some/model")


def test_load_full_state_dict_is_strict():
    model = _model("llama-gqa-untied")
    sd = full_state_dict(model)
    fresh = GPT(GPTConfig(**CONFIGS["llama-gqa-untied"]))
    load_full_state_dict(fresh, sd)
    assert all(torch.equal(v, sd[k]) for k, v in full_state_dict(fresh).items())

    missing = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    with pytest.raises(StateDictError, match=r"missing key\(s\): lm_head\.weight"):
        load_full_state_dict(fresh, missing)
    with pytest.raises(StateDictError, match=r"unexpected key\(s\): layers\.9\.mlp\.fc_in\.weight"):
        load_full_state_dict(fresh, dict(sd, **{"layers.9.mlp.fc_in.weight": torch.zeros(1)}))
    load_full_state_dict(fresh, dict(sd, **{"layers.9.mlp.fc_in.weight": torch.zeros(1)}), partial=True)
    bad = dict(sd, **{"embedding.word_embeddings.weight": torch.zeros(100, 32)})
    before = full_state_dict(fresh)
    with pytest.raises(StateDictError, match=r"embedding\.word_embeddings\.weight has shape \(100, 32\), "
                                             r"the model expects \(101, 32\)"):
        load_full_state_dict(fresh, bad)
    assert all(torch.equal(v, before[k]) for k, v in full_state_dict(fresh).items())  # nothing half-loaded


def test_bias_free_gpt2_trained_with_biases_in_hf_comes_back_with_biases():
    model = _model("gpt2-nobias")
    hf_cfg, hf_sd = to_hf(full_state_dict(model), model.config)
    hf = AutoModelForCausalLM.from_config(hf_cfg).eval()
    hf.load_state_dict(hf_sd, strict=False)
    hf.tie_weights()
    with torch.no_grad():
        hf.transformer.h[1].mlp.c_fc.bias.normal_()  # as HF finetuning of the export would do
    config, sd = from_hf(hf)
    assert config.bias is True
    back = GPT(config).eval()
    load_full_state_dict(back, sd)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_rel(back(ids), hf(ids).logits) < 1e-5


def test_load_full_state_dict_with_a_name_map_into_a_stage():
    """A pipeline stage holding some layers under other names takes its tensors from the full state dict."""
    model = _model("gpt2")
    sd = full_state_dict(model)
    stage = torch.nn.ModuleDict({"3": GPT(GPTConfig(**CONFIGS["gpt2"])).layers[1]})  # stage-local name "3.*"
    load_full_state_dict(stage, sd, partial=True, name_map=lambda n: "layers.1." + n.split(".", 1)[1])
    assert torch.equal(stage["3"].attention.qkv.weight, sd["layers.1.attention.qkv.weight"])
    assert torch.equal(stage["3"].input_norm.bias, sd["layers.1.input_norm.bias"])


class _NotATensor:  # pickled by torch.save; weights_only loading must refuse to run it
    pass


def test_weight_files_are_read_safely(tmp_path):
    sd = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    save_state_dict(sd, tmp_path / "w.safetensors")
    torch.save(sd, tmp_path / "w.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        for lazy in (False, True):
            got = read_state_dict(path, lazy=lazy)
            assert sorted(got) == ["a", "b"] and all(torch.equal(got[k], sd[k]) for k in sd)
    torch.save({"a": _NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(StateDictError, match=r"evil\.pt: contains a pickled object of type test_hf_convert\._NotATensor, not allowed"):
        read_state_dict(tmp_path / "evil.pt")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(StateDictError, match=r"cut\.safetensors is not a readable safetensors file"):
        read_state_dict(tmp_path / "cut.safetensors")
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors does not exist"):
        read_state_dict(tmp_path / "missing.safetensors")
