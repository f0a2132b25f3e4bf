"""An mLSTM pretraining run through every command, as a user runs them: pretrain, export_hf --verify, evaluate
--checkpoint and evaluate --hf of the export, which give the same bits per character."""
import inspect
import json
import sys
import textwrap

from cli import run_cli
from run_utils import ds_config

MODEL = {"model_type": "mlstm", "embed_dim": 8, "hidden_size": 32, "num_layers": 1, "seq_length": 32}
DS = ds_config(stage=0)  # ZeRO-1 fp32 exports: issue 12, class 5


def _run(*cmd, cwd):
    return run_cli([sys.executable, "-m", *cmd], cwd)


def test_mlstm_run_exports_verifies_and_evaluates_the_same(tmp_path):
    (tmp_path / "corpus.txt").write_text(inspect.getsource(textwrap))
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(inspect.getsource(json)[:3000])
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    run = tmp_path / "run"
    _run("pipeline.pretrain", "--model-type", "mlstm", "--model-config", tmp_path / "model.json",
         "--deepspeed_config", tmp_path / "ds.json", "--data", tmp_path / "corpus.txt", "--train-steps", "6",
         "--lr-warmup-steps", "1", "--save", run, "--cache-dir", tmp_path / "cache", cwd=tmp_path)

    export = tmp_path / "hf"
    out = _run("pipeline.export_hf", "--checkpoint", run, "--out", export, "--verify", cwd=tmp_path).stdout
    assert "verify: max relative logit difference" in out, out

    bpc = {}
    for flag, source in (("--checkpoint", run), ("--hf", export)):
        result = tmp_path / f"bpc{flag}.json"
        _run("pipeline.evaluate", "--task", "bpc", "--data", held_out, flag, source, "--out", result,
             "--no-progress", "--device", "cpu", cwd=tmp_path)
        record = json.loads(result.read_text())
        bpc[flag] = record["results"]["bits_per_character"]
        assert record["settings"]["context_length"] == MODEL["seq_length"]
    assert 0 < bpc["--checkpoint"] < 9
    assert abs(bpc["--checkpoint"] - bpc["--hf"]) < 1e-4 * bpc["--hf"], bpc
