"""The E-c baseline benchmark's code runs end to end on a slice of the real data (numbers: bench/)."""
import sys
from pathlib import Path

import numpy as np

from conftest import shared_data
from finetune.data import load_semeval_ec
from finetune.scoring.metrics import format_comparison, multilabel_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from emotion_baseline import run_baseline  # noqa: E402


def test_baseline_on_a_slice():
    train = load_semeval_ec(shared_data("semeval2018-ec", "train.tsv")).subset(np.arange(800))
    dev = load_semeval_ec(shared_data("semeval2018-ec", "dev.tsv")).subset(np.arange(200))
    result = run_baseline(train, dev, folds=2)
    systems = result["systems"]
    assert len(systems) == 5 and result["dev_probabilities"].shape == (200, 11)
    all_zero = multilabel_scores(dev.labels, np.zeros_like(dev.labels))["micro_f1"]
    honest = systems["tf-idf+LR, thresholds per-class + micro-F1, CV on train"]
    assert all_zero == 0.0 and honest["micro_f1"] > 0.4
    # thresholds tuned per class on dev maximise each class's dev F1 over the grid: never below CV-tuned ones
    assert systems["tf-idf+LR, thresholds per-class F1, tuned on dev (optimistic)"]["macro_f1"] >= \
        systems["tf-idf+LR, thresholds per-class F1, CV on train"]["macro_f1"]
    assert "CV on train" in format_comparison(systems)
