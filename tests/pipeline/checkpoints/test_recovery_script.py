"""The run's zero_to_fp32.py is the project's: ``python RUN/zero_to_fp32.py RUN OUT`` on a TP 2 run (where
DeepSpeed's own fails: "Expected 1 of '*_optim_states.pt' ... but found 2 files") writes the full weights, equal to
``read_full_checkpoint``; a bad tag is one line."""
import sys

import torch
from cli import run_cli
from run_utils import TINY_GPT2, NO_DROPOUT, write_corpus, write_job_files

from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.checkpoints.model_dir import read_model_dir
from pipeline.checkpoints.recovery_script import script_text


def test_zero_to_fp32_of_a_tp2_run_is_the_projects_full_weights(tmp_path):
    write_job_files(tmp_path, {**TINY_GPT2, **NO_DROPOUT}, write_corpus(tmp_path).read_text())
    run = tmp_path / "run"
    run_cli([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "pipeline.pretrain",
             "--model-config", "model.json", "--deepspeed_config", "ds.json", "--data", "corpus.txt",
             "--tokenizer", "bytes", "--seq-length", "16", "--tensor-parallel", "2", "--train-steps", "2",
             "--save", run], tmp_path)
    script = run / "zero_to_fp32.py"
    assert script.read_text() == script_text()  # DeepSpeed's copy replaced
    proc = run_cli([sys.executable, script, run, tmp_path / "out"], tmp_path)
    assert "wrote the full weights" in proc.stdout
    _, theirs, _ = read_model_dir(tmp_path / "out")
    config, ours, _ = read_full_checkpoint(run)
    assert theirs.keys() == ours.keys() and config.hidden_size == 32
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name], value, rtol=0, atol=0, msg=name)
    bad = run_cli([sys.executable, script, run, tmp_path / "out2", "-t", "global_step9"], tmp_path, check=False)
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip() and "[real_accelerator.py" not in ln]
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "global_step9" in lines[0], \
        bad.stderr
    assert not (tmp_path / "out2").exists()
