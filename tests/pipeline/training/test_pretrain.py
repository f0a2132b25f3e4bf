"""The main job end to end: python -m, torchrun, the deepspeed launcher (one node and two nodes on loopback)."""
import inspect
import json
import json as json_mod
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
from cli import run_cli
from conftest import ROOT
from dist import run_distributed
from run_utils import ds_config

from pipeline.engine.distributed import free_port
from pipeline.pretrain import main

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
FP32_DS = ds_config(stage=1)
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text: the source of a few standard-library modules, as one document each."""
    d = tmp_path_factory.mktemp("corpus")
    text = "\n\n".join(inspect.getsource(m) for m in (json_mod, textwrap, inspect))
    (d / "corpus.txt").write_text(text)
    return d / "corpus.txt"


def job_args(tmp_path, corpus, *extra, ds=FP32_DS, model=MODEL):
    (tmp_path / "model.json").write_text(json.dumps(model))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return ["--model-config", str(tmp_path / "model.json"), "--deepspeed_config", str(tmp_path / "ds.json"),
            "--data", str(corpus), "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1",
            "--cache-dir", str(tmp_path / "cache"), *extra]


def run(cmd, tmp_path, timeout=300):
    return run_cli(cmd, tmp_path, timeout=timeout)


def metrics(save):
    return [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()]


def test_single_process_writes_metrics_and_checkpoint(tmp_path, corpus):
    save = tmp_path / "run"
    run([sys.executable, "-m", "pipeline.pretrain", *job_args(tmp_path, corpus, "--train-steps", "12",
                                                                "--save", str(save), "--peak-tflops", "1.0")], tmp_path)
    records = [r for r in metrics(save) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "lr", "loss_scale", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu"):
        assert records[-1][key] is not None, key
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert (save / "latest").read_text().strip() == "global_step12"
    assert (save / "global_step12" / "COMPLETE.json").is_file()
    assert json.loads((save / "config.json").read_text())["hidden_size"] == 32
    assert (save / "tokenizer" / "tokenizer.json").is_file()


def test_torchrun_pipeline_parallel(tmp_path, corpus):
    save = tmp_path / "run"
    run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(ROOT / "pipeline" / "pretrain.py"),
         *job_args(tmp_path, corpus, "--pipeline-parallel", "2", "--micro-batch-size", "2", "--train-steps", "3",
                   "--save", str(save))], tmp_path)
    assert len([r for r in metrics(save) if "loss" in r]) == 3
    layout = json.loads((save / "global_step3" / "layout.json").read_text())
    assert (layout["pipeline_parallel"], layout["data_parallel"]) == (2, 1)


def test_deepspeed_launcher_tensor_parallel(tmp_path, corpus):
    save = tmp_path / "run"
    run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
         str(ROOT / "pipeline" / "pretrain.py"),
         *job_args(tmp_path, corpus, "--tensor-parallel", "2", "--train-steps", "3", "--save", str(save))], tmp_path)
    assert len([r for r in metrics(save) if "loss" in r]) == 3
    assert json.loads((save / "global_step3" / "layout.json").read_text())["tensor_parallel"] == 2


def test_two_node_launch_on_loopback(tmp_path, corpus):
    """Two launcher processes, one per 'node', joined by a hostfile: the multi-node path without ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    save = tmp_path / "run"
    port = str(free_port())
    cmds = [[str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
             "--master_addr", "127.0.0.1", "--master_port", port, str(ROOT / "pipeline" / "pretrain.py"),
             *job_args(tmp_path, corpus, "--train-steps", "3", "--save", str(save))] for node in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}"}
    procs = [subprocess.Popen(c, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    layout = json.loads((save / "global_step3" / "layout.json").read_text())
    assert layout["data_parallel"] == 2
    assert len([r for r in metrics(save) if "loss" in r]) == 3


def test_bad_layout_is_refused_before_work(tmp_path, corpus):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.pretrain", *job_args(tmp_path, corpus, "--tensor-parallel", "2")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "world size 1: not divisible by --tensor-parallel 2 x --pipeline-parallel 1" in proc.stderr


def _pretrain(rank, argv):
    return main(argv)


def test_mlstm_through_the_main_job_dp2(tmp_path, corpus):
    """--model-type mlstm: byte tokenizer, TBPTT streams per DP rank, ZeRO-1, bits per character."""
    save = tmp_path / "mlstm"
    model = {"model_type": "mlstm", "embed_dim": 16, "hidden_size": 64, "num_layers": 1, "seq_length": 32}
    (tmp_path / "mlstm.json").write_text(json.dumps(model))
    (tmp_path / "ds.json").write_text(json.dumps({**FP32_DS, "train_batch_size": 8}))
    argv = ["--model-type", "mlstm", "--model-config", str(tmp_path / "mlstm.json"), "--deepspeed_config",
            str(tmp_path / "ds.json"), "--data", str(corpus), "--train-steps", "15", "--lr", "1e-2",
            "--lr-decay-style", "linear", "--lr-warmup-steps", "2", "--lr-scale-base-batch", "4", "--lr-max", "1e-2",
            "--eval-interval", "15", "--eval-iters", "2", "--cache-dir", str(tmp_path / "cache"), "--save", str(save)]
    last = run_distributed(_pretrain, 2, argv)[0]
    records = [r for r in metrics(save) if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    lrs = [r["lr"] for r in records]  # 1e-2 x 8/4 capped at 1e-2, warmup, then linear decay to zero
    assert max(lrs) == pytest.approx(1e-2) and lrs[-1] == 0.0
    assert last["valid_bpc"] == pytest.approx(last["valid_loss"] / 0.6931471805599453)
    assert json.loads((save / "config.json").read_text())["model_type"] == "mlstm"
    assert json.loads((save / "global_step15" / "layout.json").read_text())["data_parallel"] == 2


def test_main_job_trains_from_every_source_form(tmp_path, corpus):
    """One run over .txt, .jsonl (another text field), .csv, .parquet, a folder glob and a save_to_disk dir."""
    docs = [d for d in corpus.read_text().split("\n\n") if d.strip()]
    parts = [docs[i::5] for i in range(5)]
    (tmp_path / "a.txt").write_text("\n\n".join(parts[0]))
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in parts[1]:
            f.write(json.dumps({"body": d, "id": 1}) + "\n")
    datasets.Dataset.from_dict({"body": parts[2]}).to_csv(str(tmp_path / "c.csv"))
    datasets.Dataset.from_dict({"body": parts[3]}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"body": parts[4]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "e.txt").write_text("\n\n".join(parts[0][:5]))
    sources = [tmp_path / "b.jsonl", tmp_path / "c.csv", tmp_path / "d.parquet", tmp_path / "saved",
               f"{tmp_path}/folder/*.txt"]
    save = tmp_path / "run"
    argv = job_args(tmp_path, corpus, "--train-steps", "3", "--save", str(save), "--text-field", "body")
    argv[argv.index("--data") + 1] = ",".join(map(str, sources))
    run([sys.executable, "-m", "pipeline.pretrain", *argv], tmp_path)
    assert len([r for r in metrics(save) if "loss" in r]) == 3
