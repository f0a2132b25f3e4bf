"""Metrics against hand-computed values and the official scorer's definitions; thresholds; eval.json; chart."""
import json

import numpy as np
import pytest

from finetune.scoring.metrics import evaluate_probabilities, format_comparison, jaccard_accuracy, multilabel_scores, plot_per_class_f1, single_label_scores, write_eval_json
from finetune.scoring.thresholds import THRESHOLDS_FILE, apply_thresholds, bagged_thresholds, load_thresholds, save_thresholds, tune_thresholds

# Tiny example, computed by hand:
#   class 0: tp 2 fp 0 fn 0 -> P 1, R 1, F1 1     class 1: tp 0 fp 1 fn 1 -> 0     class 2: tp 0 fp 1 fn 1 -> 0
#   micro: tp 2, fp 2, fn 2 -> P = R = F1 = 1/2;   macro-F1 = 1/3
#   Jaccard per tweet: {0,2} vs {0,1} -> 1/3;  {} vs {} -> 1 (official convention);  {0,1} vs {0} -> 1/2;  {} vs {2} -> 0
GOLD = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
PRED = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1]])


def test_multilabel_scores_by_hand():
    s = multilabel_scores(GOLD, PRED, ["a", "b", "c"])
    assert s["micro_f1"] == pytest.approx(0.5) and s["micro_precision"] == pytest.approx(0.5)
    assert s["micro_recall"] == pytest.approx(0.5)
    assert s["macro_f1"] == pytest.approx(1 / 3)
    assert s["jaccard"] == pytest.approx((1 / 3 + 1 + 1 / 2 + 0) / 4)  # 11/24
    assert s["exact_match"] == pytest.approx(0.25)
    assert s["per_class"]["a"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 2, "predicted": 2}
    assert s["per_class"]["b"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1, "predicted": 1}


def _official_jaccard(gold, pred):
    """The official scorer's sklearn<0.21 jaccard_similarity_score on label indicator rows, re-derived."""
    scores = []
    for g, p in zip(gold.astype(bool), pred.astype(bool)):
        union = np.sum(g | p)
        scores.append(1.0 if union == 0 else np.sum(g & p) / union)
    return float(np.mean(scores))


def test_jaccard_matches_official_definition():
    assert jaccard_accuracy(np.zeros((3, 4)), np.zeros((3, 4))) == 1.0  # all tweets neutral and predicted so
    assert jaccard_accuracy([[0, 0]], [[1, 0]]) == 0.0
    rng = np.random.default_rng(0)
    gold, pred = (rng.random((200, 11)) < 0.15).astype(int), (rng.random((200, 11)) < 0.15).astype(int)
    assert (gold.sum(1) == 0).any() and ((gold.sum(1) == 0) & (pred.sum(1) == 0)).any()
    assert jaccard_accuracy(gold, pred) == pytest.approx(_official_jaccard(gold, pred))


def test_single_label_scores_by_hand():
    s = single_label_scores([0, 1, 1, 0], [0, 1, 0, 0], ["neg", "pos"])
    assert s["accuracy"] == pytest.approx(0.75)
    assert s["per_class"]["neg"]["f1"] == pytest.approx(0.8) and s["per_class"]["pos"]["f1"] == pytest.approx(2 / 3)
    assert s["macro_f1"] == pytest.approx((0.8 + 2 / 3) / 2)


def test_metrics_refuse_probabilities():
    with pytest.raises(ValueError, match="must be 0/1"):
        multilabel_scores(GOLD, GOLD * 0.7)


# ------------------------------------------------------------------------------------- thresholds

def test_tuning_rescues_a_class_scored_below_half():
    rng = np.random.default_rng(1)
    y = np.zeros((200, 2), dtype=int)
    y[:60, 0] = 1
    y[::3, 1] = 1
    p = np.empty((200, 2))
    p[:60, 0] = rng.uniform(0.31, 0.40, 60)  # every score of class 0 lies in [0.2, 0.4]:
    p[60:, 0] = rng.uniform(0.20, 0.29, 140)  # at 0.5 it is never predicted
    p[:, 1] = np.where(y[:, 1] == 1, rng.uniform(0.55, 0.9, 200), rng.uniform(0.05, 0.6, 200))
    at_half = multilabel_scores(y, apply_thresholds(p, 0.5))
    assert at_half["per_class"]["label_0"]["f1"] == 0.0
    t = tune_thresholds(y, p)
    assert 0.29 < t[0] <= 0.31
    tuned = multilabel_scores(y, apply_thresholds(p, t))
    assert tuned["per_class"]["label_0"]["f1"] == 1.0
    assert tuned["micro_f1"] > at_half["micro_f1"] and tuned["macro_f1"] > at_half["macro_f1"]


def test_micro_refinement_drops_a_hopeless_class():
    # class 0: 100 separable positives; class 1: 10 positives that score no higher than its 100 negatives.
    # Best per-class F1 for class 1 is to predict it everywhere (F1 2/12); micro-F1 is higher without it.
    y = np.zeros((200, 2), dtype=int)
    y[:100, 0] = 1
    y[100:110, 1] = 1
    p = np.zeros((200, 2))
    p[:, 0] = np.where(y[:, 0] == 1, 0.9, 0.1)
    p[100:200, 1] = 0.4
    per_class = tune_thresholds(y, p, refine=None)
    refined = tune_thresholds(y, p, refine="micro")
    f_class = multilabel_scores(y, apply_thresholds(p, per_class))
    f_micro = multilabel_scores(y, apply_thresholds(p, refined))
    assert f_class["per_class"]["label_1"]["predicted"] == 100
    assert f_micro["per_class"]["label_1"]["predicted"] == 0
    assert f_micro["micro_f1"] == pytest.approx(200 / 210) and f_micro["micro_f1"] > f_class["micro_f1"]
    assert f_micro["macro_f1"] < f_class["macro_f1"]  # the trade-off the refinement makes


def test_refinement_never_lowers_micro_f1_and_class_without_positives_keeps_default():
    rng = np.random.default_rng(2)
    y = (rng.random((300, 6)) < [0.4, 0.3, 0.2, 0.1, 0.05, 0.0]).astype(int)
    p = np.clip(0.25 * y + rng.random((300, 6)) * 0.7, 0, 1)
    base = tune_thresholds(y, p, refine=None)
    refined = tune_thresholds(y, p, refine="micro")
    assert base[5] == refined[5] == 0.5
    micro = lambda t: multilabel_scores(y, apply_thresholds(p, t))["micro_f1"]  # noqa: E731
    assert micro(refined) >= micro(base) >= micro(np.full(6, 0.5)) - 1e-12


def _rare_class(n, rng):
    """Labels ~6% positive and probabilities that separate them imperfectly (a rare E-c class)."""
    y = (rng.random((n, 1)) < 0.06).astype(int)
    logits = np.where(y == 1, rng.normal(0.3, 1.0, y.shape), rng.normal(-2.0, 1.0, y.shape))
    return y, 1 / (1 + np.exp(-logits))


def test_bagged_thresholds_vary_less_and_score_no_worse_on_new_data():
    """Tuned on 300 texts (~18 positives), a rare class's threshold jumps with the sample; the mean over
    bootstrap resamples stays closer to the threshold tuned on a large sample, and scores at least as well on
    fresh data, averaged over many draws."""
    rng = np.random.default_rng(0)
    y_big, p_big = _rare_class(200_000, rng)
    best = tune_thresholds(y_big, p_big, refine=None)[0]
    y_new, p_new = _rare_class(20_000, rng)
    errors, f1 = {"plain": [], "bagged": []}, {"plain": [], "bagged": []}
    for draw in range(30):
        y, p = _rare_class(300, rng)
        for name, t in (("plain", tune_thresholds(y, p, refine=None)),
                        ("bagged", bagged_thresholds(y, p, refine=None, resamples=40, seed=draw))):
            errors[name].append(abs(t[0] - best))
            pred = apply_thresholds(p_new, t)
            tp, fp, fn = (pred & y_new).sum(), (pred & (1 - y_new)).sum(), ((1 - pred) & y_new).sum()
            f1[name].append(2 * tp / (2 * tp + fp + fn))
    assert np.mean(errors["bagged"]) < 0.8 * np.mean(errors["plain"]), errors
    assert np.mean(f1["bagged"]) >= np.mean(f1["plain"]) - 1e-3, (np.mean(f1["bagged"]), np.mean(f1["plain"]))
    # a class no resample sees a positive of keeps the plain tuning's threshold; resamples must be >= 1
    y = np.zeros((50, 2), dtype=int)
    y[0, 1] = 1
    t = bagged_thresholds(y, np.full((50, 2), 0.3), refine=None, resamples=5)
    assert t[0] == 0.5 and 0 < t[1] < 1
    with pytest.raises(ValueError, match="resamples must be at least 1"):
        bagged_thresholds(y, np.full((50, 2), 0.3), resamples=0)


def test_apply_thresholds_and_input_checks():
    assert apply_thresholds(np.array([[0.5, 0.49]]), [0.5, 0.5]).tolist() == [[1, 0]]  # predicted at >= t
    with pytest.raises(ValueError, match="logits"):
        tune_thresholds(np.zeros((2, 1)), np.array([[2.0], [-1.0]]))
    with pytest.raises(ValueError, match="3 thresholds for 2 labels"):
        apply_thresholds(np.zeros((1, 2)), [0.1, 0.2, 0.3])


def test_thresholds_file_round_trip(tmp_path):
    t = np.array([0.31, 0.5, 0.07])
    path = save_thresholds(tmp_path / THRESHOLDS_FILE, t, ["a", "b", "c"], tuned_on="dev.tsv", refine="micro")
    doc = json.loads(path.read_text())
    assert doc["labels"] == ["a", "b", "c"] and doc["tuned_on"] == "dev.tsv"
    assert np.array_equal(load_thresholds(path, ["a", "b", "c"]), t)
    assert np.array_equal(load_thresholds(tmp_path), t)  # a model directory
    with pytest.raises(ValueError, match=rf"{path}: thresholds are for labels \['a', 'b', 'c'\]"):
        load_thresholds(path, ["a", "c", "b"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_thresholds(tmp_path / "bad.json")


# --------------------------------------------------------------------------------- eval.json, chart

def test_evaluate_write_and_plot(tmp_path):
    rng = np.random.default_rng(3)
    y = (rng.random((100, 3)) < 0.3).astype(int)
    p = np.clip(0.3 * y + rng.random((100, 3)) * 0.6, 0, 1)
    t = tune_thresholds(y, p)
    result = evaluate_probabilities(y, p, ["joy", "fear", "trust"], t)
    assert result["tuned"]["thresholds"] == {"joy": t[0], "fear": t[1], "trust": t[2]}
    assert result["at_0.5"]["micro_f1"] == multilabel_scores(y, (p >= 0.5).astype(int))["micro_f1"]
    path = write_eval_json(tmp_path / "eval.json", result, model="m", n_train=np.int64(5))
    doc = json.loads(path.read_text())
    assert doc["model"] == "m" and doc["n_train"] == 5 and doc["tuned"]["per_class"]["fear"]["support"] == y[:, 1].sum()
    assert [f.name for f in tmp_path.iterdir()] == ["eval.json"]  # no temporary file left behind
    with pytest.raises(ValueError, match="not finite"):
        write_eval_json(tmp_path / "nan.json", {"x": float("nan")})
    png = plot_per_class_f1(tmp_path / "f1.png", result, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    table = format_comparison({"baseline": result["at_0.5"], "tuned": result["tuned"]})
    assert "[1]  baseline" in table and "trust" in table and f"{result['tuned']['micro_f1']:.3f}" in table
