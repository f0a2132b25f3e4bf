"""Export to Hugging Face: transformers loads the directory as GPT2LMHeadModel / LlamaForCausalLM with no missing
weights, its logits equal the project model's within 1e-4 relative (fp32) and greedy generate continues the same,
also when the model was trained at TP=2; the command writes atomically and refuses to overwrite."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, shared_data
from dist import run_distributed
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast

from models import GPT, GPTConfig
from models.parallel import (
    full_state_dict,
    get_shard_spec,
    initialize_model_parallel,
    model_parallel_seed,
    tp_rank,
    tp_world_size,
)
from pipeline.hf.export import compare_with_hf, export_hf, max_relative_difference
from pipeline.export_hf import main as export_main
from pipeline.hf.convert import ConversionError
from pipeline.checkpoints.state_dicts import expected_full_shape, save_state_dict

TINY = dict(vocab_size=101, hidden_size=32, num_layers=2, max_position_embeddings=24, make_vocab_size_divisible_by=8,
            hidden_dropout=0.1, attention_dropout=0.1)
CONFIGS = {
    "gpt2": dict(variant="gpt2", num_heads=4, **TINY),
    "llama-gqa-untied": dict(variant="llama", num_heads=8, num_kv_heads=4, ffn_hidden_size=48, tie_embeddings=False,
                             rope_theta=5000.0, **TINY),
    "llama-tied": dict(variant="llama", num_heads=4, num_kv_heads=2, ffn_hidden_size=48, **TINY),
}
NEW_TOKENS = 8
TOL = 1e-4


def _perturb_norms_and_biases(model, seed=7):
    """Norms at 1 and biases at 0 would hide a swapped weight and bias: draw them, as full tensors, then shard."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name or name.endswith(".bias"):
                full = torch.randn(expected_full_shape(p), generator=torch.Generator().manual_seed(seed + i)) * 0.3
                if "norm" in name and name.endswith(".weight"):
                    full += 1.0
                spec = get_shard_spec(p)
                p.copy_(spec.shard(full, *_tp()) if spec is not None else full)


def _tp():
    return tp_rank(), tp_world_size()


def _tokens():
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))


def _build(name, tp):
    initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(1234)
    model = GPT(GPTConfig(**CONFIGS[name])).eval()
    _perturb_norms_and_biases(model)
    return model


def _trained_at_tp(rank, tp, names):
    out = {}
    for name in names:
        model = _build(name, tp)
        ids = _tokens()
        with torch.no_grad():
            out[name] = {"sd": full_state_dict(model), "logits": model(ids), "generated": model.generate(ids[:, :4], NEW_TOKENS)}
    return out


@pytest.fixture(scope="module")
def tp2_models():
    """Each config built at TP=2 on two gloo ranks: gathered full state dict, logits, greedy continuation."""
    results = run_distributed(_trained_at_tp, 2, 2, list(CONFIGS))
    for name in CONFIGS:  # both ranks agree (the gathered logits are replicated)
        assert torch.equal(results[0][name]["logits"], results[1][name]["logits"])
    return results[0]


def _load_hf(path):
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing / unexpected / mismatched weights
    return model.eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_export_from_tp2_logits_and_generate(name, tp2_models, tmp_path):
    ref = tp2_models[name]
    config = GPTConfig(**CONFIGS[name])
    export_hf(config, ref["sd"], tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]
    hf = _load_hf(tmp_path / "hf")
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel"}.get(config.variant, "LlamaForCausalLM")
    assert hf.config.tie_word_embeddings == config.tie_embeddings
    ids = _tokens()
    with torch.no_grad():
        diff = max_relative_difference(hf(ids).logits, ref["logits"])
        generated = hf.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    print(f"export {name} from TP=2: max relative logit difference {diff:.2e}")
    assert diff < TOL
    assert torch.equal(generated, ref["generated"])

    # The same model rebuilt at TP=1 from the full state dict gives the same logits as well (TP1 path).
    assert compare_with_hf(config, ref["sd"], tmp_path / "hf", ids) < TOL


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_export(dtype, torch_dtype, tp2_models, tmp_path):
    name = "llama-gqa-untied"
    config = GPTConfig(**CONFIGS[name])
    export_hf(config, tp2_models[name]["sd"], tmp_path / "hf", dtype=dtype)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {{"bfloat16": "BF16", "float16": "F16"}[dtype]}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == dtype
    assert _load_hf(tmp_path / "hf").dtype == torch_dtype
    diff = compare_with_hf(config, tp2_models[name]["sd"], tmp_path / "hf")  # mapping only: weights rounded alike
    print(f"{dtype} export: max relative logit difference against the rounded weights {diff:.2e}")
    assert diff < TOL
    off = dict(tp2_models[name]["sd"], **{"final_norm.norm.weight": tp2_models[name]["sd"]["final_norm.norm.weight"] * 1.01})
    assert compare_with_hf(config, off, tmp_path / "hf") > 1e-3  # --verify would catch a wrong weight


@pytest.fixture(scope="module")
def gpt2_tokenizer_dir(tmp_path_factory):
    tok = GPT2TokenizerFast.from_pretrained(str(shared_data("tokenizers", "gpt2", "merges.txt").parent))
    assert len(tok) == 50257
    out = tmp_path_factory.mktemp("gpt2-tokenizer")
    tok.save_pretrained(out)
    return out


def test_export_command_with_tokenizer_refuses_overwrite(gpt2_tokenizer_dir, tmp_path, capsys):
    """The command on a model directory (config.json + model.safetensors + tokenizer), as import_hf writes it."""
    torch.manual_seed(0)
    config = GPTConfig(**dict(CONFIGS["gpt2"], vocab_size=50257))
    model = GPT(config).eval()
    _perturb_norms_and_biases(model)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config.to_dict()))
    save_state_dict(full_state_dict(model), ckpt / "model.safetensors")
    for f in gpt2_tokenizer_dir.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())

    out = tmp_path / "exported"
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "exported GPT2LMHeadModel" in printed and "verify: max relative logit difference" in printed

    hf = _load_hf(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert hf.generation_config.eos_token_id == tok.eos_token_id == 50256
    ids = tok(["The quick brown fox jumps over the lazy dog."], return_tensors="pt").input_ids
    with torch.no_grad():
        diff = max_relative_difference(hf(ids).logits, model(ids))
        ours = model.generate(ids, NEW_TOKENS)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    print(f"export gpt2 with tokenizer: max relative logit difference on real text {diff:.2e}")
    assert diff < TOL
    # HF stops at the end-of-text token; the project's generate does not
    assert torch.equal(theirs, ours[:, :theirs.shape[1]])
    assert theirs.shape[1] == ours.shape[1] or theirs[0, -1] == tok.eos_token_id

    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(SystemExit) as e:
        export_main(["--checkpoint", str(ckpt), "--out", str(out)])
    assert e.value.code == 2
    assert f"output directory {out} is not empty; choose another one or pass --force" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out), "--force", "--dtype", "bf16"]) == 0
    assert _load_hf(out).dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "exported"]  # no temporary directory left


def test_export_command_errors_are_clear(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(CONFIGS["gpt2"]))
    run = subprocess.run([sys.executable, "-m", "pipeline.export_hf", "--checkpoint", str(tmp_path / "ckpt"),
                          "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert f"checkpoint directory {tmp_path / 'ckpt'} has no model.safetensors (found: config.json)" in run.stderr
    assert not (tmp_path / "out").exists()


def test_tokenizer_of_another_model_is_refused(gpt2_tokenizer_dir, tp2_models, tmp_path):
    with pytest.raises(ConversionError, match=r"has 50257 tokens but the model's vocabulary has 101"):
        export_hf(GPTConfig(**CONFIGS["gpt2"]), tp2_models["gpt2"]["sd"], tmp_path / "out",
                  tokenizer_dir=gpt2_tokenizer_dir)
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too
