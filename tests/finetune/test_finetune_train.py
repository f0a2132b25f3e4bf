"""The finetuning job end to end on real E-c tweets: it learns (beats the best constant predictor), writes the
classifier, eval.json, predictions in the official format and the Hugging Face export; TP=2 and DP=2 give the
single-process losses; predict; clear refusals of bad arguments and inputs."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli import run_cli
from conftest import shared_data
from dist import run_distributed
from safetensors.torch import save_file

from finetune.data import load_semeval_ec
from finetune.heads import HeadConfig
from finetune.scoring.metrics import multilabel_scores
from finetune.model import build_classifier
from finetune.scoring.predictions import read_predictions
from finetune.saved import load_classifier, load_full_gpt_state, read_classifier_dir
from finetune.scoring.thresholds import apply_thresholds, load_thresholds, tune_thresholds
from models import GPT, MLSTM, GPTConfig, MLSTMConfig, save_mlstm
from models.parallel import full_state_dict
from pipeline.data import byte_tokenizer, load_tokenizer

FP32_DS = {"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {
    "lr": 3e-3, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}},
    "gradient_clipping": 1.0, "steps_per_print": 10**9}


def write_base(out: Path, variant: str = "gpt2", **overrides) -> Path:
    """A randomly initialised tiny GPT as a base model directory (config.json + model.safetensors + the GPT-2
    BPE tokenizer): what ``pipeline.import_hf`` writes for a real model."""

    tok = load_tokenizer(str(shared_data("tokenizers", "gpt2")))
    fields = dict(variant=variant, vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                  max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    if variant == "llama":
        fields.update(num_kv_heads=2, ffn_hidden_size=128, tie_embeddings=False)
    config = GPTConfig(**{**fields, **overrides})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    save_file({k: v.contiguous() for k, v in full_state_dict(GPT(config, init_seed=0)).items()},
              str(out / "model.safetensors"))
    tok.save(out)
    return out


def ec_slice(src: Path, dst: Path, n: int, unlabelled: bool = False) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines()[:n + 1]
    if unlabelled:
        lines = [lines[0]] + ["\t".join(f.split("\t")[:2] + ["NONE"] * 11) for f in lines[1:]]
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    ec = shared_data("semeval2018-ec")
    (d / "ds.json").write_text(json.dumps(FP32_DS))
    return {"dir": d, "base": write_base(d / "base"), "ds": d / "ds.json",
            "train": ec_slice(ec / "train.tsv", d / "train.tsv", 2000),
            "dev": ec_slice(ec / "dev.tsv", d / "dev.tsv", 300),
            "unlabelled": ec_slice(ec / "dev.tsv", d / "unlabelled.tsv", 40, unlabelled=True)}


def run(cmd, cwd, timeout=1200):
    return run_cli(cmd, cwd, timeout=timeout)


@pytest.fixture(scope="module")
def trained(work):
    """One real run of the job (one process): 1,600 training tweets, thresholds on 400 held-out ones."""
    save = work["dir"] / "run"
    run([sys.executable, "-m", "finetune.train", "--base", str(work["base"]), "--train", str(work["train"]),
         "--dev", str(work["dev"]), "--test", str(work["unlabelled"]), "--deepspeed_config", str(work["ds"]),
         "--epochs", "3", "--lr", "3e-3", "--max-length", "48", "--holdout", "0.2", "--log-interval", "5",
         "--save", str(save)], work["dir"])
    return save


def test_finetune_learns_and_writes_everything(trained, work):

    ev = json.loads((trained / "eval.json").read_text())
    assert ev["settings"]["thresholds_tuned_on"] == "holdout"
    ours = ev["dev"]["tuned"]
    # The best constant predictor: each label's training rate as its probability, thresholds tuned on dev itself.
    train, dev = load_semeval_ec(work["train"]), load_semeval_ec(work["dev"])
    prior = np.tile(train.labels.mean(axis=0), (len(dev), 1))
    constant = multilabel_scores(dev.labels, apply_thresholds(prior, tune_thresholds(dev.labels, prior)))
    print(f"dev micro-F1: finetuned {ours['micro_f1']:.3f} (at 0.5: {ev['dev']['at_0.5']['micro_f1']:.3f}), "
          f"best constant predictor {constant['micro_f1']:.3f}, all-zero 0")
    assert ours["micro_f1"] > constant["micro_f1"] + 0.02
    assert ev["dev"]["at_0.5"]["micro_f1"] > 0.2  # the all-zero predictor scores 0

    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 10 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05
    assert any("dev_micro_f1" in r for r in records)  # evaluated after each epoch

    thresholds = load_thresholds(trained, list(dev.label_names))
    assert ours["thresholds"] == dict(zip(dev.label_names, thresholds.tolist()))
    predicted = read_predictions(trained / "dev_predictions.txt")
    assert predicted.ids == dev.ids and predicted.texts == dev.texts and predicted.labels.shape == dev.labels.shape
    assert multilabel_scores(dev.labels, predicted.labels)["micro_f1"] == pytest.approx(ours["micro_f1"])
    assert read_predictions(trained / "test_predictions.txt").ids == load_semeval_ec(
        work["unlabelled"], require_labels=False).ids
    for name in ("classifier.json", "model.safetensors", "tokenizer/tokenizer.json", "per_class_f1.png",
                 "hf/config.json", "hf/model.safetensors"):
        assert (trained / name).is_file(), name


def test_predict_writes_official_format_with_tuned_thresholds(trained, work, capsys):

    out = work["dir"] / "pred_unlabelled.txt"
    proc = run([sys.executable, "-m", "finetune.predict", "--model", str(trained), "--data", str(work["unlabelled"]),
                "--out", str(out)], work["dir"])
    assert "micro-F1" not in proc.stdout  # nothing to score
    data = load_semeval_ec(work["unlabelled"], require_labels=False)
    clf = load_classifier(trained)
    written = read_predictions(out)
    assert written.ids == data.ids and written.texts == data.texts
    assert out.read_text().splitlines()[0].split("\t") == ["ID", "Tweet", *clf.label_names]
    assert np.array_equal(written.labels, apply_thresholds(clf.predict_proba(data.texts), clf.thresholds))

    from finetune.predict import main
    labelled = work["dir"] / "pred_dev.txt"
    main(["--model", str(trained), "--data", str(work["dev"]), "--out", str(labelled),
          "--eval-json", str(work["dir"] / "pred_eval.json")])
    shown = capsys.readouterr().out
    assert "micro-F1" in shown and "tuned thresholds" in shown
    ev = json.loads((trained / "eval.json").read_text())["dev"]["tuned"]
    assert json.loads((work["dir"] / "pred_eval.json").read_text())["tuned"]["micro_f1"] == pytest.approx(
        ev["micro_f1"], abs=1e-6)


def test_classifier_dir_is_a_base_model(trained):
    config, encoder, tokenizer_dir = load_full_gpt_state(trained)
    info, full = read_classifier_dir(trained)
    assert config.hidden_size == 64 and tokenizer_dir == trained / "tokenizer"
    assert set(encoder) == {k.removeprefix("encoder.") for k in full if k.startswith("encoder.")}
    assert torch.equal(encoder["final_norm.norm.weight"], full["encoder.final_norm.norm.weight"])


# ------------------------------------------------------------------------------------------- layouts

def _finetune_worker(rank, argv):
    from finetune.train import main
    out = main(argv)
    return {"losses": out["losses"], "dev": torch.tensor(out["dev_probabilities"]), "group_lrs": out["group_lrs"],
            "sp": out["sequence_parallel"]}


def _layout_argv(work, *extra):
    return ["--base", str(work["base"]), "--train", str(work["train"]), "--dev", str(work["dev"]),
            "--deepspeed_config", str(work["ds"]), "--global-batch-size", "16", "--micro-batch-size", "8",
            "--train-steps", "4",
            "--lr", "3e-3", "--lr-decay-style", "constant", "--warmup", "0", "--max-length", "32",
            "--pooling", "attention", "--mlp-hidden", "24", "--dropout", "0", "--aux-lm-weight", "0.5",
            "--layer-lr-decay", "0.5", "--pos-weight", "sqrt", "--hf-export", "no", *extra]


@pytest.fixture(scope="module")
def single(work):
    return run_distributed(_finetune_worker, 1, _layout_argv(work))[0]


def _same(result, reference, what):
    diffs = [abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"])]
    dev = (result["dev"] - reference["dev"]).abs().max().item()
    print(f"{what}: max relative loss difference {max(diffs):.2e} over {len(diffs)} steps; "
          f"max dev probability difference {dev:.2e}")
    assert len(diffs) == 4 and max(diffs) < 1e-4 and dev < 1e-4


def test_tensor_and_data_parallel_finetune_equals_single_process(work, single):
    # TP=2 x DP=2. Aux LM loss (vocab-parallel cross-entropy), attention pooling + MLP head, layer-wise LR decay,
    # positive weights. One process accumulates two micro-batches of 8; the two DP ranks take one each.
    results = run_distributed(_finetune_worker, 4, _layout_argv(work, "--tensor-parallel", "2"))
    for r in results:
        _same(r, single, "TP=2 x DP=2")
    lrs = dict(single["group_lrs"])
    assert lrs[1.0] == pytest.approx(3e-3) and lrs[0.5 ** 3] == pytest.approx(3e-3 * 0.125)  # embedding: L + 1 down


def _finetune_layouts_worker(rank, argvs):
    return [_finetune_worker(rank, argv) for argv in argvs]


def test_sequence_and_context_parallel_finetune_equal_single_process(work, single):
    # one 2-rank launch. TP=2 with sequence parallelism: batches of any width (padded to a multiple of TP inside the
    # encoder), the hidden states gathered for the head, the aux LM loss on them. CP=2: each rank encodes its chunk
    # (padded to a multiple of CP), the head and the aux LM loss run replicated on both ranks. The same losses and
    # dev probabilities as one process
    results = run_distributed(_finetune_layouts_worker, 2, [
        _layout_argv(work, "--tensor-parallel", "2", "--sequence-parallel"), _layout_argv(work, "--context-parallel", "2")])
    assert not single["sp"] and all(r[0]["sp"] and not r[1]["sp"] for r in results)
    for sp, cp in results:
        _same(sp, single, "TP=2 + SP")
        _same(cp, single, "CP=2")


def _label_words_worker(rank, argv):
    from finetune.train import main
    out = main(argv)
    return {"losses": out["losses"], "dev": torch.tensor(out["dev_probabilities"]),
            "exported": out.get("hf_export") is not None}


def test_label_words_classifier_trains_saves_and_predicts_the_same(work):
    # pooling "labels": the label names follow every text and each label is read at its own name; with the
    # label-correlation loss. The saved classifier appends the same prompt: predict gives the job's dev
    # probabilities. transformers' classifier cannot hold such a head: the export is skipped, not wrong.
    save = work["dir"] / "label_words"
    out = run_distributed(_label_words_worker, 1, [
        "--base", str(work["base"]), "--train", str(work["train"]), "--dev", str(work["dev"]),
        "--deepspeed_config", str(work["ds"]), "--global-batch-size", "16", "--train-steps", "6",
        "--max-length", "32", "--pooling", "labels", "--label-correlation", "0.2", "--group-by-length", "4",
        "--lr", "3e-3", "--save", str(save)])[0]
    assert not out["exported"] and not (save / "hf").exists()
    clf = load_classifier(save)
    head = clf.info["head_config"]
    assert head.pooling == "labels" and len(head.label_positions) == len(clf.label_names)
    dev = load_semeval_ec(work["dev"])
    encoded = clf.encode(dev.texts[:3])
    assert all(ids[-len(head.label_prompt):] == list(head.label_prompt) for ids in encoded)
    assert np.abs(clf.predict_proba(dev.texts) - np.asarray(out["dev"])).max() < 1e-4
    settings = json.loads((save / "eval.json").read_text())["settings"]
    assert settings["label_correlation"] == 0.2 and settings["group_by_length"] == 4


def _probe_worker(rank, argv):
    from finetune.train import main
    out = main(argv)
    return {"losses": out["losses"], "feature_seconds": out["feature_seconds"]}


def test_linear_probe_computes_features_once_and_keeps_the_encoder(work):
    save = work["dir"] / "probe"
    r = run_distributed(_probe_worker, 1, [
        "--base", str(work["base"]), "--train", str(work["train"]), "--dev", str(work["dev"]), "--deepspeed_config",
        str(work["ds"]), "--freeze-encoder", "--pooling", "mean", "--train-steps", "30", "--lr", "1e-2",
        "--max-length", "32", "--save", str(save), "--hf-export", "no"])[0]
    assert r["feature_seconds"] > 0 and np.mean(r["losses"][-5:]) < np.mean(r["losses"][:5])
    _, base, _ = load_full_gpt_state(work["base"])
    _, encoder, _ = load_full_gpt_state(save)
    assert all(torch.equal(encoder[k], v) for k, v in base.items())  # fp32 run: the frozen weights, unchanged


def _mlstm_worker(rank, argv):
    from finetune.train import main
    return {"losses": main(argv)["losses"]}


def test_mlstm_encoder_cell_state_classifier(work):
    """The byte-level mLSTM as the encoder (its final cell state, pooling 'none'), with the auxiliary LM loss,
    data parallel over 2 ranks; the saved classifier predicts what the job wrote."""
    base = work["dir"] / "mlstm"
    tok = byte_tokenizer()
    torch.manual_seed(0)
    save_mlstm(MLSTM(MLSTMConfig(vocab_size=tok.vocab_size, embed_dim=16, hidden_size=32, seq_length=64)), base)
    tok.save(base)
    save = work["dir"] / "mlstm_run"
    results = run_distributed(_mlstm_worker, 2, [
        "--base", str(base), "--train", str(work["train"]), "--dev", str(work["dev"]), "--deepspeed_config",
        str(work["ds"]), "--aux-lm-weight", "0.2", "--train-steps", "16", "--lr", "3e-2", "--max-length", "64",
        "--save", str(save), "--labels", "plutchik"])
    losses = results[0]["losses"]
    assert losses == results[1]["losses"] and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.05, losses
    info = json.loads((save / "classifier.json").read_text())
    assert info["encoder_type"] == "mlstm" and info["head_config"]["pooling"] == "none"
    assert len(info["label_names"]) == 8 and not (save / "hf").exists()  # no transformers class for it
    dev = load_semeval_ec(work["dev"]).select_labels(info["label_names"])
    predicted = read_predictions(save / "dev_predictions.txt", info["label_names"]).labels
    assert np.array_equal(load_classifier(save).predict(dev.texts), predicted)


# ----------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("change,message", [
    ({"--labels": "anger,bliss"}, "--labels: labels ['bliss'] are not in"),
    ({"--base": "{dir}/missing"}, "base model directory {dir}/missing does not exist"),
    ({"--train": "{dir}/bad.tsv"}, "{dir}/bad.tsv, line 3, column 'joy': label must be 0 or 1, found '2'"),
    ({"--tensor-parallel": "3"}, "num_heads 4 is not divisible by the tensor-parallel size 3"),
    ({"--pos-weight": "1,2"}, "--pos-weight: 2 weights for 11 labels"),
    ({"--encoder-layers": "5"}, "--encoder-layers 5: {dir}/base has only 2 layers"),
    ({"--pooling": "none"}, "--pooling none is for encoders that summarise a text themselves (the mLSTM)"),
])
def test_bad_inputs_are_refused_with_a_clear_message(work, change, message, capsys):
    from finetune.train import main
    d = work["dir"]
    rows = work["train"].read_text().splitlines()[:4]
    fields = rows[2].split("\t")
    fields[2 + 4] = "2"  # joy
    (d / "bad.tsv").write_text("\n".join(rows[:2] + ["\t".join(fields)] + rows[3:]) + "\n")
    args = {"--base": str(work["base"]), "--train": str(work["train"]), "--dev": str(work["dev"]),
            "--deepspeed_config": str(work["ds"])}
    args.update({k: v.format(dir=d) for k, v in change.items()})
    with pytest.raises(SystemExit) as e:
        main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message.format(dir=d) in err, err


def test_bad_arguments_are_refused_by_the_parser(work, capsys):
    from finetune.train import main
    with pytest.raises(SystemExit):
        main(["--base", "b", "--train", "t", "--dev", "d", "--holdout", "1.5"])
    assert "argument --holdout: '1.5' is out of range" in capsys.readouterr().err  # the flag's type
    with pytest.raises(SystemExit):
        main(["--base", "b", "--train", "t", "--dev", "d", "--mlp-hidden", "a,b"])
    assert "--mlp-hidden takes comma-separated integers" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the classifier

def _tiny_classifier(**kwargs):
    config = GPTConfig(variant="llama", vocab_size=300, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=64, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                       make_vocab_size_divisible_by=8)
    return build_classifier(config, HeadConfig(32, 5, pooling="mean", dropout=0.0), init_seed=1, **kwargs)


def test_classifier_pooled_path_padding_and_groups():
    torch.manual_seed(0)
    model = _tiny_classifier(freeze_embeddings=True).eval()
    ids, lengths = torch.randint(0, 300, (3, 7)), torch.tensor([7, 2, 5])
    logits = model(ids, lengths=lengths)
    assert torch.allclose(model(pooled=model.pool(ids, lengths=lengths)), logits, atol=1e-6)
    padded = ids.clone()
    padded[1, 2:] = 0  # what sits after a text's end does not matter (causal attention, masked pooling)
    assert torch.allclose(model(padded, lengths=lengths), logits, atol=1e-6)
    assert torch.allclose(model(ids[1:2, :2])[0], logits[1], atol=1e-5)
    with pytest.raises(ValueError, match="right-padded inputs"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]] * 3))
    groups = model.param_groups(layer_lr_decay=0.5, head_lr_mult=4.0)
    mults = {id(p): g["lr_mult"] for g in groups for p in g["params"]}
    assert id(model.encoder.embedding.word_embeddings.weight) not in mults  # frozen
    assert mults[id(model.head.output.weight)] == 4.0
    assert mults[id(model.encoder.layers[2].mlp.fc_in.weight)] == 0.5  # top layer: one step below the output side
    assert mults[id(model.encoder.layers[0].mlp.fc_in.weight)] == 0.5 ** 3
    assert all(g.get("weight_decay") == 0.0 for g in groups if g["params"][0].ndim < 2)


def test_frozen_encoder_trains_the_head_only():
    model = _tiny_classifier(freeze_encoder=True)
    ids, labels = torch.randint(0, 300, (4, 6)), torch.randint(0, 2, (4, 5)).float()
    model(ids, labels).backward()
    assert all(p.grad is None for p in model.encoder.parameters())
    assert model.head.output.weight.grad is not None
    assert [g["lr_mult"] for g in model.param_groups()] == [1.0, 1.0]  # head weight, head bias
    with pytest.raises(ValueError, match="cannot be combined with a frozen encoder"):
        _tiny_classifier(freeze_encoder=True, aux_lm_weight=0.5)
