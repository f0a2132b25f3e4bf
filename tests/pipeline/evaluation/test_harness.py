"""lm-evaluation-harness on a training checkpoint (pipeline.evaluation.harness through pipeline.evaluate --harness):
the harness's own task machinery, reading local task files offline, gives on a DeepSpeed checkpoint saved at
TP=2 (scored at TP 1 and 2, no export) what `lm_eval --model hf` gives on the same model's export."""
import json
import subprocess
import sys

import pytest
from cli import cli_env, run_cli
from conftest import ROOT, shared_data
from dist import run_distributed
from harness_utils import TASKS, check_against, write_tasks
from run_utils import ds_config

pytest.importorskip("lm_eval")
PASSAGES = 40
MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 128,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}
DS = ds_config(stage=1, lr=1e-2)


env = cli_env


def run(cmd, cwd, timeout=600):
    return run_cli(cmd, cwd, timeout=timeout)


def _pretrain(rank, argv):
    from pipeline.pretrain import main
    main(argv)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Local tasks from the first LAMBADA passages (the harness's lambada_openai definition, and a 4-way
    choice of the last word), and a checkpoint trained 4 steps at TP=2 on those passages."""
    d = tmp_path_factory.mktemp("harness")
    write_tasks(d, PASSAGES)
    (d / "model.json").write_text(json.dumps(MODEL))
    (d / "ds.json").write_text(json.dumps(DS))
    run_distributed(_pretrain, 2, [
        "--model-config", str(d / "model.json"), "--deepspeed_config", str(d / "ds.json"), "--tensor-parallel", "2",
        "--data", str(d / "lambada.jsonl"), "--text-field", "text", "--tokenizer", str(shared_data("tokenizers", "gpt2")),
        "--seq-length", "64", "--train-steps", "4", "--lr-warmup-steps", "1", "--cache-dir", str(d / "cache"),
        "--save", str(d / "run")])
    return d


@pytest.fixture(scope="module")
def reference(work):
    """`lm_eval --model hf` on the checkpoint's Hugging Face export."""
    run([sys.executable, "-m", "pipeline.export_hf", "--checkpoint", str(work / "run"), "--out", str(work / "hf")],
        ROOT)
    run(["lm_eval", "--model", "hf", "--model_args", f"pretrained={work / 'hf'},dtype=float32", "--device", "cpu",
         "--tasks", "lambada_local,lambada_choice", "--include_path", str(work / "tasks"), "--batch_size", "4",
         "--log_samples", "--output_path", str(work / "ref")], work)
    results = json.loads(next((work / "ref").rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in TASKS:
        rows = [json.loads(line) for line in next((work / "ref").rglob(f"samples_{task}_*.jsonl")).read_text()
                .splitlines()]
        samples[task] = {r["doc_id"]: r["filtered_resps"] for r in rows}
    return results, samples


def harness_args(work, out, *extra):
    return ["--harness", "lambada_local,lambada_choice", "--include-path", str(work / "tasks"), "--checkpoint",
            str(work / "run"), "--out", str(out), "--batch-size", "4", "--log-samples", *extra]


def test_checkpoint_at_tp1_equals_lm_eval_hf_on_its_export(work, reference):
    out = work / "tp1.json"
    run([sys.executable, "-m", "pipeline.evaluate", *harness_args(work, out)], work)
    record = json.loads(out.read_text())
    assert record["settings"]["tensor_parallel"] == 1
    check_against(record, reference, PASSAGES, tol=1e-5)


def _evaluate(rank, argv):
    from pipeline.evaluate import main
    record = main(argv)  # every rank scores (TP peers); rank 1's answer shows that each gets the whole result
    return record["samples"]["lambada_local"] if rank == 1 else None


def test_checkpoint_at_tp2_equals_lm_eval_hf_on_its_export(work, reference):
    out = work / "tp2.json"
    ranks = run_distributed(_evaluate, 2, harness_args(work, out, "--tensor-parallel", "2"))
    record = json.loads(out.read_text())
    assert record["settings"]["tensor_parallel"] == 2
    check_against(record, reference, PASSAGES, tol=1e-5)
    assert ranks[1] == record["samples"]["lambada_local"]  # every rank has the whole answer


def test_an_unknown_task_is_refused_by_name(work, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.evaluate", "--harness", "no_such_task", "--include-path",
                           str(work / "tasks"), "--checkpoint", str(work / "run"), "--out", str(tmp_path / "r.json")],
                          cwd=work, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no_such_task" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.json").exists()
