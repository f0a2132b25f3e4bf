"""Qwen2, Qwen3 and Mistral from Hugging Face: tiny random models that transformers builds here (nothing is
downloaded) import through the command, compute transformers' logits at TP=1 and TP=2 (max |diff| < 1e-5, fp32;
TP=2 also gives TP=1's gradients, the replicated Q/K norms included), export back as the same class with the same
tensors, config and logits; sliding windows the model cannot compute exactly are refused with the reason; a
finetuned classifier of each family exports as its *ForSequenceClassification with the project's probabilities."""
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import shared_data
from dist import run_distributed
from run_utils import ds_config, write_corpus
from test_finetune_train import FP32_DS, ec_slice
from test_hf_import import export_imported, import_each, load_imported
from transformers import (
    AutoModelForCausalLM,
    GPT2TokenizerFast,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from finetune.hf_export import compare_with_project
from finetune.train import main
from models import GPT, GPTConfig
from models.parallel import full_state_dict, initialize_model_parallel
from pipeline.data import load_tokenizer
from pipeline.hf.export import export_hf
from pipeline.hf.convert import ConversionError, to_hf
from pipeline.hf.importer import import_hf
from pipeline.import_hf import main as import_main
from pipeline.pretrain import main as pretrain_main
from pipeline.checkpoints.state_dicts import read_state_dict

TOL = 1e-5
COMMON = dict(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=24, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
FAMILIES = {  # name -> (config class, model class, settings of the family)
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=12, tie_word_embeddings=False)),
    # a window as long as the positions: full causal attention is sliding-window attention here
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=24, tie_word_embeddings=False)),
}
TOKENS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(5))


def _random_hf(config_class, model_class, **settings):
    torch.manual_seed(0)
    model = model_class(config_class(**{**COMMON, **settings})).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: a swap would go unseen
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved HF directory, HF logits on TOKENS, HF state dict)."""
    out = {}
    for name, (config_class, model_class, settings) in FAMILIES.items():
        model = _random_hf(config_class, model_class, **settings)
        with torch.no_grad():
            logits = model(TOKENS).logits
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path)
        out[name] = (path, logits, {k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    return import_each(hf_models, tmp_path_factory)


def _logits_and_grads(rank, tp, model_dirs):
    """Logits of each imported model at TP=tp, and the full gradients of a next-token loss."""
    if tp > 1:
        initialize_model_parallel(tensor_parallel=tp)
    out = {}
    for name, path in model_dirs.items():
        model = load_imported(path)
        with torch.no_grad():
            logits = model(TOKENS)
        model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
        out[name] = (logits, full_state_dict(model, grads=True))
    return out


def test_logits_equal_transformers_at_tp1_and_tp2(hf_models, imported):
    dirs = {k: str(v) for k, v in imported.items()}
    tp1 = _logits_and_grads(0, 1, dirs)
    tp2 = run_distributed(_logits_and_grads, 2, 2, dirs)
    for name in FAMILIES:
        theirs = hf_models[name][1]
        diff1 = (tp1[name][0] - theirs).abs().max().item()
        print(f"{name} at TP=1: max |logit difference| {diff1:.2e}")
        assert diff1 < TOL
        grads = tp1[name][1]
        assert grads.keys() == full_state_dict(GPT(GPTConfig.from_file(imported[name] / "config.json"))).keys()
        for rank in range(2):
            logits, grads2 = tp2[rank][name]
            diff2 = (logits - theirs).abs().max().item()
            print(f"{name} at TP=2, rank {rank}: max |logit difference| {diff2:.2e}")
            assert diff2 < TOL
            for k, g in grads.items():
                assert torch.allclose(grads2[k], g, rtol=1e-4, atol=1e-6), (name, k)
    configs = {name: GPTConfig.from_file(imported[name] / "config.json") for name in FAMILIES}
    assert (configs["qwen2"].qkv_bias, configs["qwen2"].bias, configs["qwen2"].tie_embeddings) == (True, False, True)
    assert (configs["qwen3"].qk_norm, configs["qwen3"].head_dim, configs["qwen3"].qkv_bias) == (True, 12, False)
    assert configs["mistral"].sliding_window == 24
    assert {name: c.hf_model_type for name, c in configs.items()} == {name: name for name in FAMILIES}


def test_hf_to_project_to_hf_is_exact(hf_models, imported, tmp_path):
    for name, (path, logits, hf_sd) in hf_models.items():
        export_imported(imported[name], tmp_path / name, hf_sd)
        theirs = json.loads((Path(path) / "config.json").read_text())
        ours = json.loads((tmp_path / name / "config.json").read_text())
        differ = {k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)}
        # the training settings the project keeps beside the HF fields, and the writer's version
        assert differ <= {"megatron_ds_training", "transformers_version", "initializer_range"}, (name, differ)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32).eval()
        assert type(hf).__name__ == FAMILIES[name][1].__name__
        with torch.no_grad():
            assert torch.equal(hf(TOKENS).logits, logits), name


@pytest.mark.parametrize("options, arch", [(dict(qkv_bias=True), "Qwen2ForCausalLM"),
                                           (dict(qk_norm=True, head_dim=12), "Qwen3ForCausalLM")])
def test_project_model_with_the_options_exports_as_its_family_and_back(options, arch, tmp_path):
    config = GPTConfig(variant="llama", vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=40, max_position_embeddings=24, seq_length=16, **options)
    sd = full_state_dict(GPT(config, init_seed=1))
    export_hf(config, sd, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [arch]
    back_config, _ = import_hf(tmp_path / "hf", tmp_path / "back")
    back = read_state_dict(tmp_path / "back" / "model.safetensors")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("extra", "hf_model_type")}  # noqa: E731
    assert strip(back_config.to_dict()) == strip(config.to_dict())


def test_windows_and_families_the_model_cannot_compute_are_refused(tmp_path, capsys):
    mistral = tmp_path / "mistral"
    _random_hf(MistralConfig, MistralForCausalLM, sliding_window=16).save_pretrained(mistral)
    capsys.readouterr()  # (the writer's progress bar)
    with pytest.raises(SystemExit) as e:
        import_main(["--model", str(mistral), "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "sliding_window 16 is shorter than seq_length 24 (by default max_position_embeddings)" in err
    assert not (tmp_path / "a").exists()

    qwen2 = tmp_path / "qwen2"
    _random_hf(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=8,
               max_window_layers=1).save_pretrained(qwen2)
    with pytest.raises(ConversionError, match=r"use_sliding_window=True cannot be represented"):
        import_hf(qwen2, tmp_path / "b")

    config = GPTConfig(variant="llama", vocab_size=101, hidden_size=32, num_layers=1, num_heads=4,
                       max_position_embeddings=24, qk_norm=True, hf_model_type="llama")
    with pytest.raises(ConversionError, match=r"cannot be exported as LlamaForCausalLM .*cannot hold qk_norm=True"):
        to_hf(full_state_dict(GPT(config, init_seed=0)), config)


# -- a finetune of each imported family, exported as its *ForSequenceClassification ----------------------------------

def _finetune_worker(rank, argv):
    return {"hf_export": main(argv)["hf_export"]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_finetuned_family_exports_as_its_classifier(family, tmp_path):
    config_class, model_class, settings = FAMILIES[family]
    ec = shared_data("semeval2018-ec")
    hf_dir = tmp_path / f"hf-{family}"
    _random_hf(config_class, model_class, **{**settings, "vocab_size": 50257, "max_position_embeddings": 64,
                                              "bos_token_id": 50256, "eos_token_id": 50256,
                                              **({"sliding_window": 64} if family == "mistral" else {})}
               ).save_pretrained(hf_dir)
    # transformers loads a qwen2/qwen3 directory's tokenizer as Qwen2Tokenizer (its own pre-tokenizer): GPT-2's
    # BPE in it; a mistral directory keeps the class its files name
    tokenizer_class = GPT2TokenizerFast if family == "mistral" else Qwen2Tokenizer
    tokenizer_class.from_pretrained(str(shared_data("tokenizers", "gpt2", "merges.txt").parent)).save_pretrained(hf_dir)
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "base")]) == 0
    (tmp_path / "ds.json").write_text(json.dumps(FP32_DS))
    result = run_distributed(_finetune_worker, 1, [
        "--base", str(tmp_path / "base"), "--train", str(ec_slice(ec / "train.tsv", tmp_path / "train.tsv", 64)),
        "--dev", str(ec_slice(ec / "dev.tsv", tmp_path / "dev.tsv", 32)), "--deepspeed_config",
        str(tmp_path / "ds.json"), "--global-batch-size", "16", "--micro-batch-size", "16", "--train-steps", "3",
        "--max-length", "32", "--pooling", "last", "--save", str(tmp_path / "run")])[0]
    exported = Path(result["hf_export"])
    arch = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family] + "ForSequenceClassification"
    assert json.loads((exported / "config.json").read_text())["architectures"] == [arch]
    texts = [line.split("\t")[1] for line in (tmp_path / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:7]]
    check = compare_with_project(tmp_path / "run", exported, texts)
    print(f"finetuned {family} classifier: max |p_transformers - p_project| = {check['max_abs_diff']:.2e}", file=sys.stderr)
    assert check["tokens_equal"] and check["max_abs_diff"] < 1e-4


# -- pipeline stages of an imported family --------------------------------------------------------------------------

def _pretrain(rank, argv):
    pretrain_main(argv)
    return 0


def test_imported_qwen3_trains_in_two_pipeline_stages_as_in_one(tmp_path):
    """Qwen3 (QK-norm, explicit head_dim, untied head) imported, then trained 3 steps from its weights at PP=1
    and at PP=2: the same losses (the stages are built from the same layers)."""
    config_class, model_class, settings = FAMILIES["qwen3"]
    _random_hf(config_class, model_class, **{**settings, "vocab_size": 258, "max_position_embeddings": 32}
               ).save_pretrained(tmp_path / "hf")
    load_tokenizer("bytes").save(tmp_path / "hf")  # the byte tokenizer the run trains with, travelling with the model
    import_hf(tmp_path / "hf", tmp_path / "base", pipeline_parallel=2)
    corpus = write_corpus(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(stage=1)))
    losses = {}
    for pp in (1, 2):
        save = tmp_path / f"pp{pp}"
        run_distributed(_pretrain, pp, [
            "--load", str(tmp_path / "base"), "--deepspeed_config", str(tmp_path / "ds.json"), "--data", str(corpus),
            "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1", "--train-steps", "3",
            "--micro-batch-size", "2", "--cache-dir", str(tmp_path / "cache"), "--save", str(save),
            "--pipeline-parallel", str(pp)])
        losses[pp] = [r["loss"] for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines())
                      if "loss" in r]
    print(f"qwen3 losses PP=1 {losses[1]}, PP=2 {losses[2]}", file=sys.stderr)
    assert len(losses[1]) == 3 and losses[1][-1] < losses[1][0]
    assert all(abs(a - b) / a < 1e-5 for a, b in zip(losses[1], losses[2])), losses
