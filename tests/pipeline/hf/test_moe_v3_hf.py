"""DeepSeek-V3 and Qwen2-MoE in and out of Hugging Face: tiny random models that transformers builds here (nothing is
downloaded), saved with save_pretrained; the DeepSeek-V3 files also hold one multi-token prediction depth where
DeepSeek's checkpoints keep it (``model.layers.{L}.*``, read back by transformers' own ``MtpModel.from_pretrained``
before the test relies on them). DeepSeek-V3: latent attention with a low-rank query and interleaved RoPE rows,
a dense first layer, sigmoid routing in 2 of 4 groups moved by a non-zero ``e_score_correction_bias``, two shared
experts; Qwen2-MoE: Q, K, V biases, a layer kept dense, a gated shared expert, unnormalised top-k.

``pipeline.import_hf`` gives transformers' logits (and its MTP draft logits), ``export_hf`` a directory that
``AutoModelForCausalLM`` (and ``MtpModel``) load with the same tensors, and back through the import the same state
bit for bit, the balancing bias included. One 2-rank launch: the imported models at TP2 (logits, greedy decoding
through the latent cache). One 1-rank launch: ``evaluate --checkpoint`` scores the imported model as ``--hf`` scores
the original, ``generate --greedy`` writes transformers' greedy tokens. The config's parameter and FLOP counts
agree with transformers' modules (latent attention, shared experts, MTP); a shared expert TP cannot split is
refused in one line."""
import json
import re
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from run_utils import source_text
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, Qwen2MoeConfig, \
    Qwen2MoeForCausalLM
from transformers.modeling_layers import MtpModel

from models import GPT, GPTConfig
from models.config import ConfigError
from pipeline.hf.convert import ConversionError, config_from_hf, from_hf
from models.parallel import destroy_model_parallel, initialize_model_parallel
from pipeline.checkpoints.state_dicts import load_full_state_dict, read_state_dict
from pipeline.data import load_tokenizer
from pipeline.evaluate import main as evaluate_main
from pipeline.generate import main as generate_main
from pipeline.generation.decode import generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.loading import load_generation_model
from pipeline.generation.sampling import SampleSettings
from pipeline.hf.export import export_hf
from pipeline.import_hf import main as import_main

V, L, EOS = 258, 3, 256  # the byte tokenizer's vocabulary and <|endoftext|>
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=L, num_attention_heads=4, max_position_embeddings=24,
              tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=257,
              initializer_range=0.1)  # peaked next-token distributions: greedy choices far from ties
FAMILIES = {
    "deepseek_v3": (DeepseekV3ForCausalLM, lambda: DeepseekV3Config(
        **COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, num_mtp_layers=1)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        **COMMON, num_key_value_heads=2, intermediate_size=40, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False)),
}
TOKENS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [7, 7, 30, 11]]
NEW = 8
BIAS = "layers.1.mlp.moe.deepspeed_moe.gate.balance_bias"
# measured 2026-12-05 (fp32, max abs, logits up to 2.2): import 7.7e-7 / 9.5e-7 (deepseek_v3 / qwen2_moe), MTP draft
# logits 6.9e-7, export 9.5e-7, TP2 1.1e-6 / 1.0e-6: a few ulps of float32
TOL = 5e-6


def _write_mtp_depth(model, path) -> MtpModel:
    """A random MTP depth of ``model`` written into its files as DeepSeek's checkpoints hold it: ``model.layers.{L}.``
    + enorm, hnorm, eh_proj, shared_head.norm, the decoder layer's tensors (experts one by one) and the copies of
    the embedding and output layer."""
    torch.manual_seed(1)
    mtp = MtpModel(model, 1).eval()
    prefix, files = f"model.layers.{L}.", load_file(path / "model.safetensors")
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    for name, value in mtp.layers[0].state_dict().items():
        name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                files[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                files[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            files.update({f"{prefix}mlp.experts.{e}.down_proj.weight": w.contiguous() for e, w in enumerate(value)})
        else:
            files[prefix + name] = value.contiguous()
    files[prefix + "embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    files[prefix + "shared_head.head.weight"] = files["lm_head.weight"].clone()
    save_file(files, path / "model.safetensors", metadata={"format": "pt"})
    return mtp


def _hf_mtp(path) -> tuple:
    """(the model, its MTP depth) as transformers loads them from ``path`` (its pattern for DeepSeek's depth is the
    61-layer model's ``model.layers.61``: given this model's)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]
    return model, MtpModel.from_pretrained(model).eval()


def _mtp_logits_hf(model, mtp, ids):
    """Depth 1 as transformers drafts: the last hidden states of tokens 0..s-2 and tokens 1..s-1, positions 1..s-1."""
    hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
    positions = torch.arange(1, ids.shape[1])[None]
    return mtp.shared_head(mtp.forward_layer(0, hidden, positions, None, input_ids=ids[:, 1:]))


def _mtp_logits_ours(ours, ids):
    ours.train()  # training forwards keep the MTP inputs (dropout 0, dropless: the same function)
    (depth1,) = ours.mtp.hidden_states(ours._local_hidden_states(ids), ids, ours.embedding.word_embeddings)
    ours.eval()
    return ours.lm_head(depth1)[:, :-1, :V]


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved HF directory, HF logits on TOKENS, the HF model, its MTP depth or None)."""
    out = {}
    for name, (model_class, config) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_class(config()).eval()
        with torch.no_grad():  # norms away from 1 and the balancing bias away from 0: a wrong copy shows
            moved = {k: v for k, v in model.state_dict().items() if "norm" in k or k.endswith("correction_bias")}
            for tensor in moved.values():
                tensor.add_(torch.randn_like(tensor) * 0.3)
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path)
        load_tokenizer("bytes").save(path)
        mtp = None
        if name == "deepseek_v3":
            written = _write_mtp_depth(model, path)
            model, mtp = _hf_mtp(path)
            read = mtp.layers.state_dict()
            assert all(torch.equal(v, read[k]) for k, v in written.layers.state_dict().items())
        with torch.no_grad():
            out[name] = (path, model(TOKENS).logits, model, mtp)
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    out = {}
    for name, (path, *_) in hf_models.items():
        out[name] = tmp_path_factory.mktemp("imported") / name
        assert import_main(["--model", str(path), "--out", str(out[name]), "--tensor-parallel", "2"]) == 0
    return out


def _ours(path) -> GPT:
    model = GPT(GPTConfig.from_file(path / "config.json")).eval()
    load_full_state_dict(model, read_state_dict(path / "model.safetensors", lazy=True))
    return model


def test_import_gives_transformers_logits_mtp_and_bias(hf_models, imported):
    for name, (path, logits, model, mtp) in hf_models.items():
        ours = _ours(imported[name])
        with torch.no_grad():
            diffs = {"logits": _max_diff(ours(TOKENS), logits)}
            if mtp is not None:
                diffs["mtp"] = _max_diff(_mtp_logits_ours(ours, TOKENS), _mtp_logits_hf(model, mtp, TOKENS))
        print(f"{name} import: max abs differences {diffs} (logits up to {logits.abs().max():.2f})")
        assert logits.abs().max() > 0.5 and max(diffs.values()) < TOL, name
    config = GPTConfig.from_file(imported["deepseek_v3"] / "config.json")
    assert (config.mtp_num_layers, config.multi_latent_attention, config.moe_dense_layers) == (1, True, [0])
    ours, hf = _ours(imported["deepseek_v3"]), hf_models["deepseek_v3"][2]
    hf_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.get_parameter(BIAS), hf_bias) and hf_bias.abs().min() > 0
    with torch.no_grad():  # the bias changes the experts chosen: without it, other logits
        ours.get_parameter(BIAS).zero_()
        assert _max_diff(ours(TOKENS), hf_models["deepseek_v3"][1]) > 1e-3


def test_export_loads_in_transformers_and_round_trips_bit_for_bit(hf_models, imported, tmp_path):
    for name, (path, logits, _, mtp) in hf_models.items():
        ours = _ours(imported[name])
        full = read_state_dict(imported[name] / "model.safetensors")
        config = GPTConfig.from_file(imported[name] / "config.json")
        export_hf(config, full, tmp_path / name, tokenizer_dir=imported[name])
        theirs, exported = load_file(path / "model.safetensors"), load_file(tmp_path / name / "model.safetensors")
        # the MTP depth's copies of the embedding and output layer are not written (the model's are shared)
        copies = {k for k in theirs if re.fullmatch(rf"model\.layers\.{L}\.(embed_tokens|shared_head\.head)\.weight", k)}
        assert exported.keys() == theirs.keys() - copies and all(torch.equal(exported[k], theirs[k]) for k in exported)
        if mtp is not None:  # the balancing bias is in the file, as imported
            assert torch.equal(exported["model.layers.1.mlp.gate.e_score_correction_bias"], full[BIAS])
            back, back_mtp = _hf_mtp(tmp_path / name)
            assert all(torch.equal(v, back_mtp.layers.state_dict()[k]) for k, v in mtp.layers.state_dict().items())
        else:
            back = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = _max_diff(back(TOKENS).logits, ours(TOKENS))
        print(f"{name} export: AutoModelForCausalLM vs project, max abs difference {diff:.1e}")
        assert type(back) is FAMILIES[name][0] and diff < TOL
        assert import_main(["--model", str(tmp_path / name), "--out", str(tmp_path / f"{name}-back")]) == 0
        again = read_state_dict(tmp_path / f"{name}-back" / "model.safetensors")
        assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full), name


# -- TP2 (one 2-rank launch) and the commands (one 1-rank launch) ---------------------------------------------------

def _tp2(rank, model_dirs):
    """Each imported model at TP2: its logits, and greedy decoding through the KV cache (DeepSeek-V3's: the
    compressed latent)."""
    out = {}
    for name, path in model_dirs.items():
        destroy_model_parallel()
        initialize_model_parallel(tensor_parallel=2)
        ours = GPT(GPTConfig.from_file(f"{path}/config.json")).eval()
        load_full_state_dict(ours, read_state_dict(f"{path}/model.safetensors", lazy=True))
        with torch.no_grad():
            out[name, "logits"] = ours(TOKENS)
        destroy_model_parallel()
        model, _ = load_generation_model(checkpoint=path, tensor_parallel=2)
        out[name, "greedy"] = [g.new_ids for g in generate(decoder_for(model, True), PROMPTS, SampleSettings(NEW),
                                                            eos_id=EOS)]
    destroy_model_parallel()
    return out


def _hf_greedy(model, prompts):
    """transformers' generate(do_sample=False) with its cache, one prompt at a time, new tokens up to EOS."""
    out = []
    for p in prompts:
        row = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=EOS,
                             pad_token_id=257)[0, len(p):].tolist()
        out.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return out


def test_tp2_logits_and_greedy_decoding_equal_transformers(hf_models, imported):
    ranks = run_distributed(_tp2, 2, {k: str(v) for k, v in imported.items()}, env={"OMP_NUM_THREADS": "1"})
    for name, (_, logits, model, _) in hf_models.items():
        theirs = _hf_greedy(model, PROMPTS)
        assert sum(map(len, theirs)) >= 2 * NEW, name
        for rank, res in enumerate(ranks):
            diff = _max_diff(res[name, "logits"], logits)
            print(f"{name} TP2 rank {rank}: max abs logit difference {diff:.1e}")
            assert diff < TOL and res[name, "greedy"] == theirs, (name, rank)


def _commands(rank, jobs):
    out = {}
    for key, argv in jobs.items():
        written = Path(argv[argv.index("--out") + 1])
        if key[0] == "generate":
            generate_main(argv)
            out[key] = [json.loads(line) for line in written.read_text().splitlines()]
        else:
            evaluate_main(argv)
            out[key] = json.loads(written.read_text())["results"]["bits_per_character"]
    return out


def test_evaluate_and_generate_take_the_imported_models(hf_models, imported, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(source_text()[:600])
    jobs = {("bpc", name, flag): ["--task", "bpc", "--data", str(text), flag, str(model), "--context-length", "24",
                                  "--out", str(tmp_path / f"{name}{flag}.json"), "--no-progress"]
            for name, (path, *_) in hf_models.items() for flag, model in (("--checkpoint", imported[name]),
                                                                          ("--hf", path))}
    jobs.update({("generate", name): ["--checkpoint", str(imported[name]), "--prompt", "The cat", "--greedy",
                                      "--max-new-tokens", str(NEW), "--quiet", "--out",
                                      str(tmp_path / f"{name}.jsonl")] for name in hf_models})
    results = run_distributed(_commands, 1, jobs)[0]  # a rank of its own: the commands join a process group
    for name, (_, _, model, _) in hf_models.items():
        ours, theirs = results["bpc", name, "--checkpoint"], results["bpc", name, "--hf"]
        print(f"{name}: evaluate --checkpoint {ours:.8f} bits/char, --hf {theirs:.8f}")
        assert abs(ours - theirs) < 1e-6 * theirs  # measured 2026-12-05: equal to the 8 decimals printed
        (record,) = results["generate", name]
        assert record["new_ids"] == _hf_greedy(model, [record["prompt_ids"]])[0], name


def _hf_counts(model, mtp, k: int) -> tuple[int, int]:
    """(parameters, the active matrix entries a token meets) of transformers' model and MTP depth: every parameter
    and balancing bias (a buffer there); the matrices but the embedding, k of each layer's experts, the output
    layer once per depth more (``MtpModel.shared_head``)."""
    named = [*model.named_parameters(), *model.named_buffers(),
             *([*mtp.named_parameters(), *mtp.named_buffers()] if mtp else [])]
    params = sum(t.numel() for n, t in named if "embed_tokens" not in n and "shared_head" not in n
                 and "rotary" not in n)
    active = 0
    for name, t in [*model.named_parameters(), *(mtp.named_parameters(remove_duplicate=False) if mtp else [])]:
        if t.dim() >= 2 and "embed_tokens" not in name:
            active += t.numel() * k // t.shape[0] if ".experts." in name else t.numel()
    return params + model.model.embed_tokens.weight.numel(), active


def test_parameter_and_flop_counts_agree_with_transformers(hf_models, imported):
    for name, (_, _, model, mtp) in hf_models.items():
        config = GPTConfig.from_file(imported[name] / "config.json")
        params, active = _hf_counts(model, mtp, config.moe_top_k)
        unpadded = GPTConfig.from_dict({**config.to_dict(), "make_vocab_size_divisible_by": 1})
        ours = sum(p.numel() for p in GPT(unpadded).parameters())
        if config.multi_latent_attention:
            attention = config.num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
        else:
            attention = 2 * config.num_heads * config.head_dim
        layers = config.num_layers + config.mtp_num_layers
        print(f"{name}: {params} parameters (transformers), {config.num_parameters()} (config), {ours} (model)")
        assert config.num_parameters() == params == ours, name
        assert config.flops_per_token(16) == 6 * active + 6 * layers * attention * 16, name
    odd = {**GPTConfig.from_file(imported["qwen2_moe"] / "config.json").to_dict(),
           "moe_shared_expert_intermediate_size": 25}
    with pytest.raises(ConfigError, match="moe_shared_expert_intermediate_size 25 is not divisible by the "
                                          "tensor-parallel size 2"):
        GPTConfig.from_dict(odd).check_parallel(2)


@pytest.mark.parametrize("name, field, value, message", [
    ("deepseek_v3", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_type='linear'"),
    ("deepseek_v3", "attention_bias", True, "attention_bias=True"),
    ("deepseek_v3", "n_shared_experts", 0, "n_shared_experts=0"),
    ("qwen2_moe", "use_sliding_window", True, "use_sliding_window=True"),
    ("qwen2_moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0")])
def test_what_the_model_cannot_compute_is_refused_by_name(name, field, value, message):
    config = FAMILIES[name][1]()
    setattr(config, field, value)
    with pytest.raises(ConversionError, match=re.escape(message) + " cannot be represented"):
        config_from_hf(config, "tiny")


def test_rotate_half_rope_rows_import_and_export_as_they_are(tmp_path):
    """``rope_interleave: false`` (transformers' rotate-half form, the project's): rows kept, recorded, written back."""
    config = FAMILIES["deepseek_v3"][1]()
    config.rope_interleave, config.num_mtp_layers = False, 0
    torch.manual_seed(2)
    model = DeepseekV3ForCausalLM(config).eval()
    ours_config, full = from_hf(model)
    ours = GPT(ours_config).eval()
    load_full_state_dict(ours, full)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(full["layers.0.attention.q_b_proj.weight"], model.state_dict()[q_b])
    export_hf(ours_config, full, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_interleave"] is False
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        diffs = [_max_diff(ours(TOKENS), model(TOKENS).logits), _max_diff(back(TOKENS).logits, model(TOKENS).logits)]
    assert max(diffs) < TOL, diffs
