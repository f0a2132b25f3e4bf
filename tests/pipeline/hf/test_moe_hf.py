"""Mixtral and Qwen3-MoE in and out of Hugging Face: tiny random models that transformers builds here (nothing is
downloaded), saved with save_pretrained (per-expert tensors in the files), import through the command and give
transformers' logits (fp32, dropless) in one process and, in one 4-rank gloo launch, at EP2, TP2 and (EP2, TP2),
built by the training engine from the imported directory (each rank taking its experts and its TP shard of
them). The run saved at (EP2, TP2) reads back bit for bit, ``evaluate --checkpoint`` scores it as ``evaluate --hf``
scores the original (bits per character; lm-eval tasks through ``--harness``, Mixtral), and
``export_hf --checkpoint`` gives the original files' tensors, config and logits.
Qwen3-MoE with layers kept dense (decoder_sparse_step 2, mlp_only_layers) and norm_topk_prob false; neither
family has shared experts (Qwen3-MoE has none; Qwen2-MoE's shared expert is not imported). A classifier finetuned
on each at DP2 (EP 1 and 2, the same losses and weights) trains with the router loss and exports as its
*ForSequenceClassification."""
import json
import sys
from pathlib import Path

import pytest
import torch
from cli import run_cli
from conftest import shared_data
from dist import run_distributed
from engine_utils import BASE_DS
from harness_utils import TASKS, check_against, record_answers, write_tasks
from run_utils import source_text
from test_finetune_train import FP32_DS, ec_slice
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from finetune.hf_export import compare_with_project
from models import GPT, GPTConfig
from models.moe import expert_slice
from models.parallel import Layout, full_state_dict, initialize_model_parallel
from pipeline.checkpoints.checkpoint import read_full_checkpoint, save, save_run_files
from pipeline.checkpoints.state_dicts import load_full_state_dict, read_state_dict
from pipeline.data import load_tokenizer
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import resolve_ds_config
from pipeline.evaluate import main as evaluate_main
from pipeline.hf.convert import ConversionError, to_hf
from pipeline.hf.export import export_hf
from pipeline.hf.importer import import_hf
from pipeline.hf.safetensors_io import SafetensorsFiles, hf_weight_files
from pipeline.export_hf import main as export_main
from pipeline.import_hf import main as import_main

TOL = 1e-5
# vocab_size: the byte tokenizer's vocabulary and special tokens
COMMON = dict(vocab_size=258, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=24, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256,
              eos_token_id=256, pad_token_id=257, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
FAMILIES = {  # name -> (model class, its config)
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2,
                                                          num_local_experts=4, num_experts_per_tok=2,
                                                          sliding_window=24)),
    # layers 1, 3, 5 sparse by the step, 3 kept dense: MoE at 1 and 5, dense SwiGLU (intermediate 40) elsewhere
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **COMMON, head_dim=12, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=6, num_experts=4,
        num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)),
}
TOKENS = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved HF directory, HF logits on TOKENS)."""
    out = {}
    for name, (model_class, config) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_class(config()).eval()
        with torch.no_grad():  # transformers starts norms at 1: a swap would go unseen
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(torch.randn_like(p) * 0.3)
            logits = model(TOKENS).logits
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path)
        load_tokenizer("bytes").save(path)  # travels with the import, and lets evaluate score text
        out[name] = (path, logits)
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    out = {}
    for name, (path, _) in hf_models.items():
        out[name] = tmp_path_factory.mktemp("imported") / name
        assert import_main(["--model", str(path), "--out", str(out[name]), "--tensor-parallel", "2"]) == 0
    return out


def _one_process_logits(path):
    model = GPT(GPTConfig.from_file(path / "config.json")).eval()
    load_full_state_dict(model, read_state_dict(path / "model.safetensors", lazy=True))
    with torch.no_grad():
        return model(TOKENS)


# layout -> (TP, EP) on the 4 ranks of the one launch (data parallel: what is left; EP splits it)
LAYOUTS = {"EP2": (1, 2), "TP2": (2, 1), "EP2, TP2": (2, 2)}
SAVED_AT = "EP2, TP2"


def _layout_logits(rank, model_dirs, save_root):
    """Each imported model built by the training engine from its directory at every layout (each rank taking its
    experts, and its TP shard of them, from the full state dict): its logits in evaluation, the global index of
    the rank's first expert and that expert's fc_out at TP1; at ``SAVED_AT`` a checkpoint under ``save_root``
    (each rank writing its experts' files)."""
    out = {}
    for layout, (tp, ep) in LAYOUTS.items():
        state = initialize_model_parallel(layout=Layout(tensor=tp, expert=ep))
        ds = resolve_ds_config({**BASE_DS, "train_batch_size": state.data_parallel},
                               data_parallel=state.data_parallel, pipeline_parallel=1, micro_batch_size=1)
        for name, path in model_dirs.items():
            config = GPTConfig.from_file(f"{path}/config.json")
            engine = build_engine(config, ds, state, init_seed=0,
                                  full_state_dict=read_state_dict(f"{path}/model.safetensors", lazy=True))
            engine.eval()
            local = engine.module.layers[1].mlp.moe.deepspeed_moe.experts.deepspeed_experts
            with torch.no_grad():
                out[layout, name] = (engine(TOKENS), expert_slice(engine.module).first,
                                     local[0].fc_out.weight.clone() if tp == 1 else None)
            if layout == SAVED_AT:
                save_dir = Path(save_root) / name
                if rank == 0:
                    save_run_files(save_dir, config, load_tokenizer("bytes"))
                save(engine, save_dir, 0, data_state=None, layout={
                    "tensor_parallel": tp, "pipeline_parallel": 1, "data_parallel": state.data_parallel,
                    "expert_parallel": ep, "model_type": "gpt", "precision": "fp32", "zero_stage": 1})
    return out


@pytest.fixture(scope="module")
def launch(imported, tmp_path_factory):
    """The one 4-rank launch: rank -> (layout, name) -> (logits, first expert, its fc_out); the runs saved."""
    runs = tmp_path_factory.mktemp("runs")
    return run_distributed(_layout_logits, 4, {k: str(v) for k, v in imported.items()}, str(runs)), runs


def test_imported_logits_equal_transformers_at_every_layout(hf_models, imported, launch):
    configs = {name: GPTConfig.from_file(path / "config.json") for name, path in imported.items()}
    assert [configs["qwen3_moe"].is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert (configs["qwen3_moe"].moe_norm_topk_prob, configs["qwen3_moe"].moe_top_k) == (False, 3)
    assert (configs["mixtral"].num_experts, configs["mixtral"].moe_layer_freq) == (4, 1)
    results, _ = launch
    for name, (_, theirs) in hf_models.items():
        assert theirs.abs().max() > 0.1
        diff = (_one_process_logits(imported[name]) - theirs).abs().max().item()
        print(f"{name} (EP1, TP1): max |logit difference| {diff:.2e}", file=sys.stderr)
        assert diff < TOL
        full = read_state_dict(imported[name] / "model.safetensors")
        layer = "layers.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts"
        for layout, (_, ep) in LAYOUTS.items():
            diff = max((r[layout, name][0] - theirs).abs().max().item() for r in results)
            print(f"{name} ({layout}): max |logit difference| over the 4 ranks {diff:.2e}", file=sys.stderr)
            assert diff < TOL
            firsts = [r[layout, name][1] for r in results]
            assert sorted(set(firsts)) == [0, 2][:ep] and all(firsts.count(f) == 4 // ep for f in set(firsts))
        for r in results:  # at TP1 the expert itself: global index first
            _, first, weight = r["EP2", name]
            assert torch.equal(weight, full[f"{layer}.{first}.fc_out.weight"])


def _evaluate_bpc(rank, jobs):
    out = {}
    for key, argv in jobs.items():
        evaluate_main(argv)
        out[key] = json.loads(Path(argv[argv.index("--out") + 1]).read_text())["results"]["bits_per_character"]
    return out


def test_evaluate_checkpoint_scores_an_expert_parallel_run_as_transformers(hf_models, imported, launch, tmp_path):
    """The runs saved at (EP2, TP2) (each expert's TP shard in DeepSpeed's file of its own, written by its rank)
    read back as the imported weights bit for bit, and ``evaluate --checkpoint`` gives the bits per character
    that ``evaluate --hf`` gives the original Hugging Face model."""
    _, runs = launch
    text = tmp_path / "held_out.txt"
    text.write_text(source_text()[:1500])
    jobs = {(name, flag): ["--task", "bpc", "--data", str(text), flag, str(model), "--context-length", "24",
                           "--out", str(tmp_path / f"{name}{flag}.json"), "--no-progress"]
            for name, (path, _) in hf_models.items() for flag, model in (("--checkpoint", runs / name), ("--hf", path))}
    scores = run_distributed(_evaluate_bpc, 1, jobs)[0]  # a rank of its own: the command joins a process group
    for name in hf_models:
        _, full, _ = read_full_checkpoint(runs / name)
        want = read_state_dict(imported[name] / "model.safetensors")
        assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want), name
        bpc = {flag: scores[name, flag] for flag in ("--checkpoint", "--hf")}
        print(f"{name}: evaluate --checkpoint ({SAVED_AT} run) {bpc['--checkpoint']:.6f} bits/char, --hf "
              f"{bpc['--hf']:.6f} (difference {abs(bpc['--checkpoint'] - bpc['--hf']):.1e})", file=sys.stderr)
        assert abs(bpc["--checkpoint"] - bpc["--hf"]) < 1e-5 * bpc["--hf"]


HARNESS_PASSAGES = 16


def test_harness_scores_an_expert_parallel_run_as_transformers(hf_models, launch, tmp_path):
    """``python -m pipeline.evaluate --harness`` (lm-eval's own task machinery on local LAMBADA tasks) on the
    Mixtral run saved at (EP2, TP2), scored in one process, gives the accuracies, greedy answers and per-document
    log-likelihoods that it gives the original Hugging Face model (``--hf``, transformers' Mixtral). One family:
    each command costs about 12 s (its imports); the adapter is the same for every family, and
    ``--checkpoint`` reads both (the test above)."""
    pytest.importorskip("lm_eval")
    _, runs = launch
    tasks = write_tasks(tmp_path, HARNESS_PASSAGES)
    records = {}
    for flag, model in (("--checkpoint", runs / "mixtral"), ("--hf", hf_models["mixtral"][0])):
        out = tmp_path / f"mixtral{flag}.json"
        run_cli([sys.executable, "-m", "pipeline.evaluate", "--harness", ",".join(TASKS), "--include-path", tasks,
                 flag, model, "--out", out, "--batch-size", "8", "--log-samples"], tmp_path)
        records[flag] = json.loads(out.read_text())
    assert (records["--checkpoint"]["model"]["format"], records["--hf"]["model"]["class"]) == ("project",
                                                                                             "MixtralForCausalLM")
    print(f"mixtral: evaluate --harness --checkpoint ({SAVED_AT} run) against --hf:", file=sys.stderr)
    # 1e-5, as for dense runs: each log-likelihood sums the fp32 log-probabilities (near -5.5, ulp 4.8e-7) of a
    # word's bytes, each a few ulps apart (the logits differ by 1e-7)
    check_against(records["--checkpoint"], record_answers(records["--hf"]), HARNESS_PASSAGES, tol=1e-5)


def _file_tensors(directory) -> dict:
    files = SafetensorsFiles(hf_weight_files(directory))
    return {k: files[k] for k in files}



def _finetune_each(rank, runs):
    from finetune.train import main as finetune_main
    return {name: finetune_main(argv).get("hf_export") for name, argv in runs.items()}  # rank 0 exports


def test_finetuned_moe_base_adds_its_router_loss_and_exports_as_its_classifier(imported, tmp_path):
    """finetune.train on the imported Mixtral and Qwen3-MoE at DP2, at EP 1 and at EP 2: the MoE layers'
    auxiliary loss is part of the training loss (logged as moe_aux_loss); both layouts give the same losses and
    save the same classifier (every expert, gathered over the EP group); it exports as
    Mixtral/Qwen3MoeForSequenceClassification with the project's probabilities."""
    ec = shared_data("semeval2018-ec")
    (tmp_path / "ds.json").write_text(json.dumps(FP32_DS))
    train, dev = ec_slice(ec / "train.tsv", tmp_path / "train.tsv", 32), ec_slice(ec / "dev.tsv", tmp_path / "dev.tsv", 16)
    runs = {(name, ep): ["--base", str(imported[name]), "--train", str(train), "--dev", str(dev),
                         "--deepspeed_config", str(tmp_path / "ds.json"), "--global-batch-size", "16",
                         "--micro-batch-size", "8", "--train-steps", "2", "--log-interval", "1", "--max-length", "16",
                         "--pooling", "last", "--head-bias", "no", "--expert-parallel", str(ep),
                         "--save", str(tmp_path / f"{name}-ep{ep}")]
            for name in imported for ep in (1, 2)}
    exported = run_distributed(_finetune_each, 2, runs)[0]
    texts = [line.split("\t")[1] for line in dev.read_text(encoding="utf-8").splitlines()[1:7]]
    for name in imported:
        steps = {ep: [json.loads(line) for line in (tmp_path / f"{name}-ep{ep}" / "metrics.jsonl").read_text()
                      .splitlines() if "\"loss\"" in line] for ep in (1, 2)}
        assert len(steps[1]) == 2 and all(r["moe_aux_loss"] > 0 for r in steps[1]), name
        assert all(abs(r["loss"] - r["cls_loss"] - r["moe_aux_loss"]) < 1e-6 for r in steps[1]), name
        loss_diff = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(steps[1], steps[2], strict=True))
        saved = {ep: load_file(tmp_path / f"{name}-ep{ep}" / "model.safetensors") for ep in (1, 2)}
        assert saved[1].keys() == saved[2].keys(), name
        weight_diff = max((saved[1][k] - saved[2][k]).abs().max().item() for k in saved[1])
        assert loss_diff < 1e-5 and weight_diff < 1e-5, name
        out = exported[name, 1]
        arch = {"mixtral": "MixtralForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification"}
        assert json.loads((Path(out) / "config.json").read_text())["architectures"] == [arch[name]]
        check = compare_with_project(tmp_path / f"{name}-ep1", out, texts)
        print(f"finetuned {name} at DP2: moe_aux_loss {steps[1][0]['moe_aux_loss']:.4f} at step 1; EP2 vs EP1: "
              f"losses {loss_diff:.1e} relative, saved weights {weight_diff:.1e}; exported classifier max "
              f"|p_transformers - p_project| = {check['max_abs_diff']:.2e}", file=sys.stderr)
        assert check["tokens_equal"] and check["max_abs_diff"] < 1e-5, name


def test_hf_to_project_to_hf_is_exact(hf_models, launch, tmp_path):
    """Hugging Face -> import -> the (EP2, TP2) engine -> its checkpoint -> ``export_hf --checkpoint``: the
    original files' tensors, config and logits."""
    _, runs = launch
    for name, (path, logits) in hf_models.items():
        assert export_main(["--checkpoint", str(runs / name), "--out", str(tmp_path / name)]) == 0
        theirs, ours = _file_tensors(path), _file_tensors(tmp_path / name)
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        hf_cfg = json.loads((path / "config.json").read_text())
        our_cfg = json.loads((tmp_path / name / "config.json").read_text())
        differ = {k for k in hf_cfg.keys() | our_cfg.keys() if hf_cfg.get(k) != our_cfg.get(k)}
        assert differ <= {"megatron_ds_training", "transformers_version", "initializer_range"}, (name, differ)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32).eval()
        assert type(hf) is FAMILIES[name][0]
        with torch.no_grad():
            assert torch.equal(hf(TOKENS).logits, logits), name


def test_project_moe_exports_as_the_family_that_holds_it_and_back(tmp_path):
    """A model trained here: every layer MoE -> Mixtral, with QK-norm and every other layer -> Qwen3-MoE; back
    through the import, the same tensors and config (the z-loss and capacity, training-only, travel in the
    training record); a layout Mixtral cannot hold is refused by name."""
    base = dict(variant="llama", vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=40, max_position_embeddings=24, seq_length=16, num_experts=4, moe_ffn_hidden_size=16,
                moe_z_loss_coeff=0.001, moe_capacity_factor=1.5)
    # (Mixtral has one intermediate size: its experts'; a dense ffn_hidden_size beside it would not come back)
    for options, arch in ((dict(moe_ffn_hidden_size=40), "MixtralForCausalLM"),
                          (dict(qk_norm=True, moe_layer_freq=2, moe_norm_topk_prob=False), "Qwen3MoeForCausalLM")):
        config = GPTConfig(**{**base, **options})
        sd = full_state_dict(GPT(config, init_seed=1))
        export_hf(config, sd, tmp_path / arch)
        assert json.loads((tmp_path / arch / "config.json").read_text())["architectures"] == [arch]
        back_config, _ = import_hf(tmp_path / arch, tmp_path / f"{arch}-back")
        back = read_state_dict(tmp_path / f"{arch}-back" / "model.safetensors")
        assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
        strip = lambda d: {k: v for k, v in d.items() if k not in ("extra", "hf_model_type")}  # noqa: E731
        assert strip(back_config.to_dict()) == strip(config.to_dict())
    config = GPTConfig(**base, moe_layer_freq=2, hf_model_type="mixtral")
    with pytest.raises(ConversionError, match=r"cannot be exported as MixtralForCausalLM .*moe_layer_freq=2"):
        to_hf(full_state_dict(GPT(config, init_seed=0)), config)
