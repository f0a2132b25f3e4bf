"""The documented E-c recipes end to end on a few hundred real tweets, trained by the ensemble command
(``python -m finetune.ensemble``, ``finetune.recipes.EC_ENSEMBLE``'s members): the last-token recipe
(``EC_RECIPE``) trains, tunes per-class thresholds on held-out train, and the Hugging Face classifier it exports
gives ``finetune.predict``'s probabilities (fp32, within 1e-5) and, with the thresholds stored in its config, the
same decisions on every dev tweet. The ensemble of it, a label-words classifier and the TF-IDF model averages
their probabilities, tunes its thresholds on the held-out tweets (never on dev), and ``finetune.predict`` serves
it with the scores the command wrote; a rerun reuses the trained members. The TF-IDF model saved without pickle
gives scikit-learn's probabilities. And the threshold objectives: per-class F1 maximises macro-F1 where the
micro-F1 refinement does not; the balanced refinement serves the mean of both."""
import json
import shutil
import sys

import numpy as np
import pytest
from conftest import shared_data
from sklearn.metrics import f1_score
from test_finetune_train import FP32_DS, ec_slice, run, write_base
from transformers import pipeline

from finetune.data import load_semeval_ec
from finetune.ensemble.predictor import load_member
from finetune.ensemble.build import main as ensemble_main
from finetune.job.inputs import holdout_split
from finetune.normalize import TweetNormalizer
from finetune.recipes import EC_RECIPE as RECIPE
from finetune.scoring.metrics import multilabel_scores
from finetune.scoring.predictions import read_predictions
from finetune.scoring.thresholds import (DEFAULT_GRID, apply_thresholds, bagged_thresholds, load_thresholds,
                                         tune_thresholds)
from finetune.ensemble.tfidf import TfidfClassifier, build_model


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    ec = shared_data("semeval2018-ec")
    (d / "ds.json").write_text(json.dumps(FP32_DS))
    base = write_base(d / "base", variant="llama")  # the recipe's base (SmolLM2) is a llama
    train, dev = ec_slice(ec / "train.tsv", d / "train.tsv", 400), ec_slice(ec / "dev.tsv", d / "dev.tsv", 120)
    ens = d / "ensemble"
    # the recipes as documented, on a tiny base and a few hundred tweets: fewer epochs, an fp32 config
    command = [sys.executable, "-m", "finetune.ensemble", "--save", str(ens), "--base", str(base),
               "--train", str(train), "--dev", str(dev), "--recipe", "last:1234", "--recipe", "labels:7", "--tfidf",
               "--dtype", "float32", "--", "--deepspeed_config", str(d / "ds.json"), "--epochs", "2", "--lr", "1e-3",
               "--max-length", "24"]  # short enough that many tweets are cut: the export must cut them the same way
    log = run(command, d).stdout
    return {"dir": d, "save": ens / "members" / "last-1234", "dev": dev, "train": train, "ensemble": ens,
            "command": command, "log": log}


def test_recipe_trains_tunes_and_exports(recipe_run):
    save = recipe_run["save"]
    ev = json.loads((save / "eval.json").read_text())
    settings = ev["settings"]
    assert settings["thresholds_tuned_on"] == "holdout" and settings["threshold_objective"] == \
        RECIPE[RECIPE.index("--threshold-objective") + 1]
    assert settings["pooling"] == RECIPE[RECIPE.index("--pooling") + 1] and not settings["freeze_encoder"]
    assert settings["pos_weight"] is not None and max(settings["pos_weight"]) > 1.0  # sqrt weights for rare labels
    assert ev["dev"]["tuned"]["macro_f1"] > 0.0
    assert (save / "hf" / "config.json").is_file() and (save / "hf" / "model.safetensors").is_file()


def test_exported_recipe_classifier_equals_predict_on_every_dev_tweet(recipe_run):

    d, save = recipe_run["dir"], recipe_run["save"]
    out, probs_file = d / "pred.txt", d / "probs.tsv"
    run([sys.executable, "-m", "finetune.predict", "--model", str(save), "--data", str(recipe_run["dev"]),
         "--out", str(out), "--probabilities", str(probs_file)], d)
    rows = [line.split("\t") for line in probs_file.read_text().splitlines()]
    names = rows[0][1:]
    ours = np.array([[float(x) for x in r[1:]] for r in rows[1:]])
    decided = read_predictions(out)

    config = json.loads((save / "hf" / "config.json").read_text())
    clf = pipeline("text-classification", model=str(save / "hf"), top_k=None, device="cpu")
    normalizer = TweetNormalizer(**config["tweet_normalizer"])
    got = clf([normalizer(t) for t in decided.texts], batch_size=16, truncation=True)  # to the training length
    theirs = np.array([[{x["label"]: x["score"] for x in row}[n] for n in names] for row in got])
    assert ours.std() > 1e-3  # not a comparison of constants
    assert np.abs(theirs - ours).max() < 1e-5
    hf_decisions = apply_thresholds(theirs, config["thresholds"])
    assert np.array_equal(hf_decisions, decided.labels)
    assert len(decided.ids) == 120


def test_ensemble_thresholds_come_from_the_held_out_tweets_and_predict_serves_it(recipe_run):
    ens, d = recipe_run["ensemble"], recipe_run["dir"]
    info = json.loads((ens / "ensemble.json").read_text())
    assert info["members"] == ["members/last-1234", "members/labels-7", "members/tfidf"]  # relative: movable
    members = [load_member(ens / m) for m in info["members"]]
    for m in members[:2]:  # the classifiers trained on the other nine tenths of the same file
        assert (m.info["training"]["holdout"], m.info["training"]["holdout_seed"]) == (0.1, 1234)
    assert members[2].training["holdout_seed"] == 1234
    train, dev = load_semeval_ec(recipe_run["train"]), load_semeval_ec(recipe_run["dev"])
    fit, held = holdout_split(len(train), 0.1, 1234)
    tune = train.subset(held)
    averaged = np.mean([m.predict_proba(tune.texts) for m in members], axis=0)
    expected = bagged_thresholds(tune.labels, averaged, refine="mean", resamples=100, seed=1234)
    np.testing.assert_allclose(load_thresholds(ens, list(dev.label_names)), expected, atol=1e-12)

    out, probs_file, ev_file = d / "ens_pred.txt", d / "ens_probs.tsv", d / "ens_eval.json"
    run([sys.executable, "-m", "finetune.predict", "--model", str(ens), "--data", str(recipe_run["dev"]),
         "--out", str(out), "--probabilities", str(probs_file), "--eval-json", str(ev_file)], d)
    served = np.array([[float(x) for x in r.split("\t")[1:]] for r in probs_file.read_text().splitlines()[1:]])
    assert served.std() > 1e-3
    np.testing.assert_allclose(served, np.mean([m.predict_proba(dev.texts) for m in members], axis=0), atol=2e-6)
    written = json.loads((ens / "eval.json").read_text())
    for key in ("micro_f1", "macro_f1", "jaccard"):
        assert json.loads(ev_file.read_text())["tuned"][key] == pytest.approx(written["dev"]["tuned"][key], abs=1e-6)
    assert len(written["members"]) == 3
    assert read_predictions(out).labels.shape == dev.labels.shape


def test_ensemble_rerun_reuses_its_members_and_refuses_a_different_split(recipe_run, capsys):
    d, ens, command = recipe_run["dir"], recipe_run["ensemble"], recipe_run["command"][3:]
    with pytest.raises(SystemExit) as e:
        ensemble_main(command)
    assert e.value.code == 2 and "already holds an ensemble; pass --force" in capsys.readouterr().err
    ensemble_main([*command[:command.index("--")], "--force"])
    log = capsys.readouterr().out
    assert log.count("already trained, reused") == 2 and "already fitted, reused" in log
    other = d / "other_member"  # a classifier that held out other tweets
    shutil.copytree(ens / "members" / "labels-7", other)
    doc = json.loads((other / "classifier.json").read_text())
    doc["training"]["holdout_seed"] = 99
    (other / "classifier.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit):
        ensemble_main(["--save", str(d / "ens2"), "--member", str(ens / "members" / "last-1234"),
                       "--member", str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differ in holdout_seed (1234 and 99)" in err[0] and not (d / "ens2").exists()


def test_tfidf_member_saved_without_pickle_gives_scikit_learns_probabilities(recipe_run):
    loaded = load_member(recipe_run["ensemble"] / "members" / "tfidf")
    train, dev = load_semeval_ec(recipe_run["train"]), load_semeval_ec(recipe_run["dev"])
    fit, _ = holdout_split(len(train), 0.1, 1234)
    normalizer = loaded.normalizer
    sub = train.subset(fit)
    reference = build_model().fit([normalizer(t) for t in sub.texts], sub.labels)
    theirs = reference.predict_proba([normalizer(t) for t in dev.texts])
    assert isinstance(loaded, TfidfClassifier) and theirs.std() > 1e-3
    np.testing.assert_allclose(loaded.predict_proba(dev.texts), theirs, atol=1e-6)


def _scores(y, p, t):
    return multilabel_scores(y, apply_thresholds(p, t))


def _macro_f1(y, p, t):
    return _scores(y, p, t)["macro_f1"]


def test_threshold_objectives_per_class_micro_and_balanced():
    rng = np.random.default_rng(7)
    n = 600
    # one frequent, well-separated class and two rare, noisy ones: the micro refinement trades the rare
    # classes' recall for fewer false positives overall, which micro-F1 rewards and macro-F1 does not
    y = np.stack([rng.random(n) < 0.5, rng.random(n) < 0.06, rng.random(n) < 0.08], axis=1).astype(np.int8)
    p = np.clip(np.stack([0.25 + 0.5 * y[:, 0] + rng.normal(0, 0.15, n),
                          0.2 + 0.25 * y[:, 1] + rng.normal(0, 0.15, n),
                          0.2 + 0.2 * y[:, 2] + rng.normal(0, 0.15, n)], axis=1), 0, 1)
    per_class = tune_thresholds(y, p, refine=None)
    micro = tune_thresholds(y, p, refine="micro")
    assert _macro_f1(y, p, per_class) > _macro_f1(y, p, micro) + 1e-3
    # the balanced refinement climbs the mean of the two averages from the per-class optimum
    balanced = tune_thresholds(y, p, refine="balanced")
    mean = {name: (lambda s: (s["micro_f1"] + s["macro_f1"]) / 2)(_scores(y, p, t))
            for name, t in (("per_class", per_class), ("micro", micro), ("balanced", balanced))}
    assert mean["balanced"] >= max(mean["per_class"], mean["micro"]) - 1e-12
    assert _macro_f1(y, p, balanced) > _macro_f1(y, p, micro)
    assert _scores(y, p, balanced)["micro_f1"] > _scores(y, p, per_class)["micro_f1"]
    # the "mean" refinement climbs the mean of micro-F1, macro-F1 and Jaccard above every other objective's
    three = {name: (lambda s: (s["micro_f1"] + s["macro_f1"] + s["jaccard"]) / 3)(_scores(y, p, t))
             for name, t in (("per_class", per_class), ("micro", micro), ("balanced", balanced),
                             ("mean", tune_thresholds(y, p, refine="mean")))}
    assert three["mean"] >= max(three["per_class"], three["micro"], three["balanced"]) - 1e-12
    assert three["mean"] > three["per_class"] + 1e-3
    # per class, no grid threshold gives a better F1: per-class F1 is the macro-F1 optimum on the grid
    for c in range(y.shape[1]):
        best = max(f1_score(y[:, c], p[:, c] >= t) for t in DEFAULT_GRID)
        assert f1_score(y[:, c], p[:, c] >= per_class[c]) == pytest.approx(best, abs=1e-12)
