"""The exported Hugging Face classifier computes the project classifier's probabilities (``transformers.pipeline``,
padded batches, fp32), for GPT-2 with its output bias taken into the final LayerNorm and for Llama (GQA, untied);
heads that ``*ForSequenceClassification`` cannot hold are refused with the setting named."""
import json

import numpy as np
import pytest
import torch
from conftest import shared_data
from transformers import pipeline

from finetune.hf_export import ExportError, compare_with_project, export_classifier
from finetune.export_hf import main
from finetune.heads import HeadConfig
from finetune.model import build_classifier
from finetune.normalize import TweetNormalizer
from finetune.saved import load_classifier, save_classifier_dir
from models import GPTConfig
from models.parallel import full_state_dict
from pipeline.data import load_tokenizer

TWEETS = ["I am so happy today!!! 😀", "This is terrible, I'm furious #angry @user",
          "not sure what to expect tomorrow... http://t.co/abc", "Thank you for the lovely flowers &amp; the card",
          "ugh", "Lost my keys again. Why does this always happen to me?"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_classifier_dir(out, variant="gpt2", pooling="last", mlp_hidden=(), bias=True,
                        labels=("anger", "joy", "sadness")):
    tok = load_tokenizer(str(shared_data("tokenizers", "gpt2")))
    fields = dict(variant=variant, vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                  max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    if variant == "llama":
        fields.update(num_kv_heads=2, ffn_hidden_size=64, tie_embeddings=False)
    config = GPTConfig(**fields)
    head = HeadConfig(32, len(labels), pooling=pooling, mlp_hidden=mlp_hidden, label_names=labels, output_bias=bias)
    model = build_classifier(config, head, init_seed=3, label_priors=[0.3, 0.1, 0.05] if bias else None)
    with torch.no_grad():  # a head that has learnt something: weights well away from their init
        model.head.output.weight.normal_(0, 1.0)
    thresholds = [0.3, 0.42, 0.17]
    save_classifier_dir(out, full_state=full_state_dict(model), encoder_type="gpt", encoder_config=config,
                        head_config=head, tokenizer=tok, max_length=48, normalizer=TweetNormalizer(),
                        thresholds=thresholds)
    return out


@pytest.mark.parametrize("variant,bias", [("gpt2", True), ("llama", False)])
def test_transformers_pipeline_gives_the_project_probabilities(tmp_path, variant, bias):

    model_dir = make_classifier_dir(tmp_path / "clf", variant, bias=bias)
    hf_dir = export_classifier(model_dir, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [{"gpt2": "GPT2ForSequenceClassification",
                                        "llama": "LlamaForSequenceClassification"}[variant]]
    assert config["problem_type"] == "multi_label_classification"
    assert config["id2label"] == {"0": "anger", "1": "joy", "2": "sadness"}
    assert config["thresholds"] == [0.3, 0.42, 0.17] and config["pad_token_id"] == 50256

    ours = load_classifier(model_dir)
    expected = ours.predict_proba(TWEETS)
    normalizer = TweetNormalizer(**config["tweet_normalizer"])
    clf = pipeline("text-classification", model=str(hf_dir), top_k=None, device="cpu")
    out = clf([normalizer(t) for t in TWEETS], batch_size=4)  # padded batches
    got = np.array([[{d["label"]: d["score"] for d in row}[name] for name in ours.label_names] for row in out])
    diff = np.abs(got - expected).max()
    print(f"{variant}: max |p_transformers - p_project| = {diff:.2e}")
    assert diff < 1e-4
    assert expected.std() > 0.01  # the comparison is not between constants
    check = compare_with_project(model_dir, hf_dir, TWEETS)
    assert check["tokens_equal"] and check["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("settings,message", [
    ({"pooling": "mean"}, "pooling is 'mean', but transformers' *ForSequenceClassification pools the last token"),
    ({"mlp_hidden": (16,)}, "the head has an MLP ([16]), but transformers' classifier is one linear layer"),
    ({"variant": "llama", "bias": True}, "train the llama classifier with --head-bias no"),
])
def test_heads_transformers_cannot_hold_are_refused(tmp_path, settings, message):
    model_dir = make_classifier_dir(tmp_path / "clf", **settings)
    with pytest.raises(ExportError) as e:
        export_classifier(model_dir, tmp_path / "hf")
    assert message in str(e.value)
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_export_command(tmp_path, capsys):
    model_dir = make_classifier_dir(tmp_path / "clf")
    assert main(["--model", str(model_dir), "--out", str(tmp_path / "hf"), "--verify"]) == 0
    assert "same tokens: True" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a non-empty output directory is not replaced without --force
        main(["--model", str(model_dir), "--out", str(tmp_path / "hf")])
    assert "is not empty" in capsys.readouterr().err
