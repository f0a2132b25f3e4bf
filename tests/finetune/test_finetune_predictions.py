"""Prediction files in the official E-c format: byte-exact round trip of the real dev file, and the
official scorer's own reading of what we write gives our scores."""
import numpy as np
import pytest

from conftest import shared_data
from finetune.data import PLUTCHIK_LABELS, SEMEVAL_EC_LABELS, load_semeval_ec
from finetune.scoring.metrics import multilabel_scores
from finetune.scoring.predictions import read_predictions, write_labeled_predictions, write_predictions


def test_dev_file_round_trip_is_byte_exact(tmp_path):
    dev_path = shared_data("semeval2018-ec", "dev.tsv")
    dev = load_semeval_ec(dev_path)
    out = write_labeled_predictions(tmp_path / "pred.tsv", dev, dev.labels)
    assert out.read_bytes() == dev_path.read_bytes()
    back = read_predictions(out)
    assert back.ids == dev.ids and back.texts == dev.texts and np.array_equal(back.labels, dev.labels)


def _official_scorer(pred_path, gold_path):
    """The official scorer's reading (utils.evaluate_multilabel): lines split on tabs into exactly 13 parts,
    labels parsed with int(), rows aligned by ID, as many lines as gold."""
    def read(path):
        lines = path.read_bytes().split(b"\n")[:-1]
        rows = {}
        for line in lines[1:]:
            parts = line.decode("utf-8").split("\t")
            assert len(parts) == 13
            rows[parts[0]] = [int(x) for x in parts[2:13]]
        return len(lines), rows
    n_pred, pred = read(pred_path)
    n_gold, gold = read(gold_path)
    assert n_pred == n_gold and pred.keys() == gold.keys()
    ids = list(gold)
    return np.array([gold[i] for i in ids]), np.array([pred[i] for i in ids])


def test_official_scorer_reads_our_predictions(tmp_path):
    gold_path = shared_data("semeval2018-ec", "dev.tsv")
    dev = load_semeval_ec(gold_path)
    rng = np.random.default_rng(0)
    pred = (rng.random(dev.labels.shape) < 0.3).astype(np.int8)
    order = rng.permutation(len(dev))  # the scorer aligns by ID, not by line
    path = write_predictions(tmp_path / "E-c_en_pred.txt", [dev.ids[i] for i in order],
                             [dev.texts[i] for i in order], pred[order])
    gold, read_pred = _official_scorer(path, gold_path)
    assert np.array_equal(gold, dev.labels) and np.array_equal(read_pred, pred)
    assert multilabel_scores(gold, read_pred) == multilabel_scores(dev.labels, pred)


def test_awkward_tweets_and_other_label_sets(tmp_path):
    texts = ["tab\there", "line\nbreak\r\nand 😀", "plain"]
    path = write_predictions(tmp_path / "p.tsv", ["1", "2", "3"], texts, np.eye(3, 8, dtype=np.int8),
                             PLUTCHIK_LABELS)
    back = read_predictions(path)
    assert back.label_names == PLUTCHIK_LABELS and back.texts == ["tab here", "line break  and 😀", "plain"]
    assert np.array_equal(back.labels, np.eye(3, 8))
    assert path.read_text().splitlines()[0] == "ID\tTweet\t" + "\t".join(PLUTCHIK_LABELS)


def test_refusals(tmp_path):
    labels = np.zeros((2, 11), dtype=np.int8)
    with pytest.raises(ValueError, match="must be 0/1"):
        write_predictions(tmp_path / "p.tsv", ["a", "b"], ["x", "y"], labels + 0.4)
    with pytest.raises(ValueError, match="unique"):
        write_predictions(tmp_path / "p.tsv", ["a", "a"], ["x", "y"], labels)
    with pytest.raises(ValueError, match="disagree"):
        write_predictions(tmp_path / "p.tsv", ["a", "b"], ["x", "y"], labels[:, :8], SEMEVAL_EC_LABELS)
    assert not (tmp_path / "p.tsv").exists()
