"""An imported DeepSeek-V3 (latent attention, MTP depth, group-limited sigmoid routing with a non-zero bias, shared
experts) and Qwen2-MoE (gated shared expert) downstream: ``evaluate --harness`` on the imported checkpoint answers
the harness's local tasks (tests/pipeline/evaluation/harness_utils.py, offline) as ``--harness --hf`` does on the
transformers model it came from (every log-likelihood, accuracy and greedy answer), and ``finetune.train`` takes it
as the base of an E-c classifier: the encoder's features of the imported model are transformers' last hidden
states, and a short run trains, tunes its thresholds, writes its predictions and a Hugging Face classifier that
transformers' ``*ForSequenceClassification`` loads with the classifier's probabilities. One 1-rank launch (the commands
join a process group)."""
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import shared_data
from dist import run_distributed
from harness_utils import check_against, record_answers, write_tasks
from run_utils import ds_config
from test_finetune_train import ec_slice
from test_moe_v3_hf import TOKENS, hf_models, imported

from finetune.data import load_semeval_ec
from finetune.heads import HeadConfig
from finetune.hf_export import compare_with_project
from finetune.model import build_classifier
from finetune.saved import load_base_state
from finetune.train import main as finetune_main
from pipeline.evaluate import main as evaluate_main

pytest.importorskip("lm_eval")
__all__ = ["hf_models", "imported"]  # the fixtures of the import tests
PASSAGES = 16
# measured 2026-12-05 (fp32, DeepSeek-V3 / Qwen2-MoE): log-likelihoods 1.4e-6 / 1.9e-6, features 1.1e-6 / 1.3e-6 (up
# to 4.7), the exported classifier's probabilities 6.0e-8 / 6.0e-8
LOGLIKELIHOOD_TOL = 2e-5
FEATURES_TOL = 1e-5
PROBABILITY_TOL = 6e-7
HF_CLASSIFIERS = {"deepseek_v3": "DeepseekV3ForSequenceClassification",
                  "qwen2_moe": "Qwen2MoeForSequenceClassification"}


def _harness(work: Path, model_flag: str, model: Path, out: Path) -> list[str]:
    return ["--harness", "lambada_local,lambada_choice", "--include-path", str(work / "tasks"), model_flag,
            str(model), "--out", str(out), "--batch-size", "4", "--log-samples", "--no-progress"]


def _finetune(work: Path, base: Path, save: Path) -> list[str]:
    return ["--base", str(base), "--train", str(work / "train.tsv"), "--dev", str(work / "dev.tsv"),
            "--deepspeed_config", str(work / "ds.json"), "--epochs", "1", "--lr", "3e-3", "--max-length", "24",
            "--holdout", "0.25", "--log-interval", "2", "--save", str(save)]


def _commands(rank, jobs):
    out = {}
    for key, argv in jobs.items():
        (evaluate_main if key[0] == "harness" else finetune_main)(argv)
    return out


@pytest.fixture(scope="module")
def runs(hf_models, imported, tmp_path_factory):
    work = tmp_path_factory.mktemp("downstream")
    write_tasks(work, PASSAGES)
    ec = shared_data("semeval2018-ec")
    ec_slice(ec / "train.tsv", work / "train.tsv", 64)
    ec_slice(ec / "dev.tsv", work / "dev.tsv", 32)
    (work / "ds.json").write_text(json.dumps({**ds_config(stage=1, train_batch_size=16)}))
    jobs = {}
    for name, (path, *_) in hf_models.items():
        for flag, model in (("--checkpoint", imported[name]), ("--hf", path)):
            jobs["harness", name, flag] = _harness(work, flag, model, work / f"{name}{flag}.json")
        jobs["finetune", name] = _finetune(work, imported[name], work / f"{name}-ec")
    run_distributed(_commands, 1, jobs)
    return work


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe"])
def test_harness_on_the_import_answers_as_transformers(runs, name):
    ours = json.loads((runs / f"{name}--checkpoint.json").read_text())
    theirs = json.loads((runs / f"{name}--hf.json").read_text())
    assert ours["model"]["format"] == "project"
    worst = check_against(ours, record_answers(theirs), PASSAGES, tol=LOGLIKELIHOOD_TOL)
    print(f"{name}: evaluate --harness --checkpoint vs --hf (transformers): max |log-likelihood difference| "
          f"{worst:.1e}")


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe"])
def test_finetune_takes_the_import_as_its_base(runs, hf_models, imported, name):
    config, state, _ = load_base_state(imported[name])
    encoder = build_classifier(config, HeadConfig(hidden_size=config.hidden_size, num_labels=11), encoder_state=state).encoder.eval()
    hf_model = hf_models[name][2]
    with torch.no_grad():
        ours = encoder.features(TOKENS)
        theirs = hf_model.model(TOKENS).last_hidden_state
    diff = float((ours - theirs).abs().max())
    print(f"{name}: finetune encoder features vs transformers' last hidden states, max abs {diff:.1e} "
          f"(up to {float(theirs.abs().max()):.1f})")
    assert diff < FEATURES_TOL
    save = runs / f"{name}-ec"
    ev = json.loads((save / "eval.json").read_text())
    assert 0.0 <= ev["dev"]["tuned"]["micro_f1"] <= 1.0
    losses = [r["loss"] for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert (save / "dev_predictions.txt").is_file() and (save / "model.safetensors").is_file()
    # the job's Hugging Face export (transformers' *ForSequenceClassification) gives the classifier's probabilities
    texts = load_semeval_ec(runs / "dev.tsv").texts[:16]
    compared = compare_with_project(save, save / "hf", texts)
    print(f"{name}: the finetuned classifier's export in transformers vs the project, max abs probability "
          f"difference {compared['max_abs_diff']:.1e}")
    assert json.loads((save / "hf" / "config.json").read_text())["architectures"] == [f"{HF_CLASSIFIERS[name]}"]
    assert compared["tokens_equal"] and compared["max_abs_diff"] < PROBABILITY_TOL
