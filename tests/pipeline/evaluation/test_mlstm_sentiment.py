"""The sentiment-neuron pipeline: threshold search, input checks, and the command end to end on SST-2."""
import json

import numpy as np
import pytest
import torch

from conftest import shared_data
from models import MLSTM, MLSTMConfig, save_mlstm
from pipeline.evaluation.sentiment_neuron import best_thresholds, featurize, read_tsv, unit_accuracy
from pipeline.sentiment_neuron import main


def test_best_thresholds_equal_brute_force():
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(40, 7)), 1)          # rounded: ties between values
    x[:, 3] = 1.0                                       # a constant column
    y = (rng.random(40) < 0.5).astype(np.int64)
    acc, thr, pol = best_thresholds(x, y, chunk=3)      # chunk < d: the chunked path
    for j in range(x.shape[1]):
        cuts = np.concatenate([[x[:, j].min() - 1], np.unique(x[:, j]) + 1e-9])
        brute = max(unit_accuracy(x[:, j], y, c, p) for c in cuts for p in (1, -1))
        assert acc[j] == pytest.approx(brute)
        assert unit_accuracy(x[:, j], y, thr[j], pol[j]) == pytest.approx(brute)
    assert acc[3] == pytest.approx(max(y.mean(), 1 - y.mean()))


def test_read_tsv_names_the_bad_line(tmp_path):
    p = tmp_path / "train.tsv"
    p.write_text("sentence\tlabel\ngood film\t1\nbad film\t2\n")
    with pytest.raises(ValueError, match=r"train.tsv:3: label must be 0 or 1, got '2'"):
        read_tsv(p)
    p.write_text("text\tlabel\nx\t1\n")
    with pytest.raises(ValueError, match=r"train.tsv:1: expected the header"):
        read_tsv(p)
    p.write_text("sentence\tlabel\na\tb\t1\n")
    with pytest.raises(ValueError, match=r"train.tsv:2: expected 2 tab-separated fields"):
        read_tsv(p)


def test_featurize_keeps_the_input_order():
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(embed_dim=4, hidden_size=8))
    texts = ["a much longer text than the others", "hi", "mid-length text", "é"]
    feats = featurize(model, texts, batch_size=2, progress=False)
    for i, t in enumerate(texts):
        alone = model.features(torch.tensor([list(t.encode())])).detach().numpy()
        np.testing.assert_allclose(feats[i:i + 1], alone, rtol=1e-5, atol=1e-6)


def test_command_end_to_end_on_sst2(tmp_path):
    data_dir = shared_data("sst2", "train.tsv").parent
    torch.manual_seed(0)
    save_mlstm(MLSTM(MLSTMConfig(embed_dim=8, hidden_size=16)), tmp_path / "model")
    r = main(["--model", str(tmp_path / "model"), "--data-dir", str(data_dir), "--out", str(tmp_path / "out"),
              "--limit", "150", "--Cs", "0.1,1", "--no-progress"])
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved == json.loads(json.dumps(r))
    assert saved["examples"] == {"train": 150, "val": 150, "test": 150}
    assert 0.0 <= saved["l1_probe"]["test_accuracy"] <= 1.0 and saved["l1_probe"]["C"] in (0.1, 1.0)
    unit = saved["single_unit"]
    _, train_labels = read_tsv(data_dir / "train.tsv", limit=150)
    majority = max(train_labels.mean(), 1 - train_labels.mean())
    assert 0 <= unit["unit"] < 16 and unit["train_accuracy"] >= majority     # a threshold never does worse
    png = (tmp_path / "out" / saved["plot"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
