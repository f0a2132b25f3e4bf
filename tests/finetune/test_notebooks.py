"""The finetuning notebooks run end to end (nbclient, a kernel of this Python) on small settings: 01 finetunes a tiny
base model on a slice of E-c and exports it, 02 classifies tweets with the export through ``transformers.pipeline``."""
import json
import sys

import nbformat
import numpy as np
import pytest
import transformers
from conftest import ROOT, shared_data
from nbclient import NotebookClient
from test_finetune_train import write_base

NOTEBOOKS = ROOT / "finetune" / "notebooks"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel spec of the running interpreter in a private Jupyter path: the notebooks run in this venv."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "finetune-tests"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "finetune tests", "language": "python"}))
    return root


def execute(name, kernel, monkeypatch, **env):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # the kernel is a job of its own
        monkeypatch.delenv(key, raising=False)
    for key, value in {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}.items():
        monkeypatch.setenv(key, str(value))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, kernel_name="finetune-tests", timeout=600,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return "\n".join(out.get("text", "") + json.dumps(out.get("data", {}))
                     for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


def test_finetune_then_classify_with_transformers(tmp_path, kernel, monkeypatch):
    data = shared_data("semeval2018-ec")
    out = tmp_path / "run"
    text = execute("01_finetune_emotions.ipynb", kernel, monkeypatch, EC_DATA_DIR=data,
                   BASE_MODEL=write_base(tmp_path / "base"), OUT_DIR=out, TRAIN_LIMIT=480, DEV_LIMIT=120,
                   EPOCHS=1, LR=3e-3, GLOBAL_BATCH=16, MAX_LENGTH=32, DS_CONFIG=ROOT / "ds_configs" / "cpu.json")
    assert "480 training and 120 dev tweets" in text
    assert "tuned thresholds" in text and "micro-F1" in text and "image/png" in text
    assert (out / "eval.json").is_file() and (out / "hf" / "config.json").is_file()

    text = execute("02_classify_with_transformers.ipynb", kernel, monkeypatch, HF_CLASSIFIER=out / "hf")
    assert "GPT2ForSequenceClassification | multi_label_classification | 11 labels" in text
    diff = float(text.split("max |transformers - project| = ")[1].split()[0])
    print(f"notebook 02: max |transformers - project| = {diff:.1e}")
    assert diff < 1e-4  # both in float32, from the fp32 master weights of the bf16 run
    assert "Nervous about the exam tomorrow" in text  # the table of scores


def test_accelerate_notebook_finetunes_the_export(tmp_path, kernel, monkeypatch):
    """03: the base exported to transformers, AutoModelForSequenceClassification trained by accelerate's DeepSpeed
    plugin from ds_configs/cpu.json as it is, the project's thresholds and chart, a classifier transformers loads."""
    out = tmp_path / "run"
    text = execute("03_finetune_with_accelerate.ipynb", kernel, monkeypatch,
                   EC_DATA_DIR=shared_data("semeval2018-ec"), BASE_MODEL=write_base(tmp_path / "base"),
                   OUT_DIR=out, TRAIN_LIMIT=480, DEV_LIMIT=120, EPOCHS=1, LR=3e-3, MAX_LENGTH=32,
                   DS_CONFIG=ROOT / "ds_configs" / "cpu.json")
    assert "432 training, 48 threshold-tuning and 120 dev tweets; 11 emotions" in text
    assert "GPT2ForSequenceClassification" in text and "ZeRO stage 1" in text
    assert "tuned on held-out train" in text and "image/png" in text
    first, last = (float(x) for x in text.split("; loss ")[1].split()[0:3:2])
    assert last < first  # the schedule's learning rate reached DeepSpeed's optimizer: the loss moved
    clf = transformers.pipeline("text-classification", model=str(out / "hf_classifier"), top_k=None)
    thresholds = clf.model.config.thresholds
    assert len(thresholds) == 11 and all(0 < t < 1 for t in thresholds)
    scores = clf(["Can't wait for the weekend!"])[0]
    assert len(scores) == 11 and np.isclose(sum(s["score"] for s in scores) > 0, True)
