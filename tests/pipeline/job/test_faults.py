"""Faults of a real cluster, on real multi-process jobs (torchrun over gloo): a stop signal to one rank saves a
complete checkpoint on every rank and the run continues bit-equal from it; a second run on one --save is
refused; a NaN loss stops the run without saving the bad state; a dead rank ends the job in bounded time."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from cli import cli_env, run_cli
from conftest import ROOT, shared_data
from run_utils import ds_config, write_job_files

from pipeline.checkpoints.state_dicts import read_state_dict
from pipeline.engine.distributed import free_port

pytestmark = pytest.mark.serial  # its bounds are seconds of wall clock

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
PRETRAIN = ROOT / "pipeline" / "pretrain.py"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    write_job_files(d, MODEL, (ROOT / "pipeline" / "job" / "loop.py").read_text() * 3, ds_config(stage=1, lr=1e-3))
    return d


def args(d, save, steps, *extra):
    return ["--model-config", d / "model.json", "--deepspeed_config", d / "ds.json", "--data", d / "corpus.txt",
            "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "0", "--lr-decay-style", "constant",
            "--train-steps", str(steps), "--cache-dir", d / "cache", "--save", save, *extra]


def torchrun(*argv):
    return ["torchrun", "--nproc_per_node", "2", "--master-port", str(free_port()), PRETRAIN, *argv]


def start(cmd, cwd):
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=120.0, what="condition", proc=None):
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"the job ended first: {proc.communicate()[1][-3000:]}"
        time.sleep(0.05)


def steps_logged(save: Path) -> int:
    path = save / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line) if path.is_file() else 0


def losses(save: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and "step" in r}


def worker(proc: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        with_env = child.environ()
        if with_env.get("RANK") == str(rank) and "pretrain.py" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no worker of rank {rank}")


def test_sigterm_to_one_rank_saves_and_resumes_bit_equal(work):
    """SIGTERM to rank 1 of a 2-rank torchrun job: both ranks stop at the same step boundary, save one complete
    checkpoint, exit 0; --load continues with the fp32 losses of a run that never stopped, bit for bit."""
    run = work / "preempted"
    proc = start(torchrun(*args(work, run, 100000)), work)
    wait_for(lambda: steps_logged(run) >= 3, what="three steps")
    t0 = time.monotonic()
    worker(proc, 1).send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stop_seconds = time.monotonic() - t0
    print(f"preemption: the job ended {stop_seconds:.1f} s after SIGTERM")
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    step = int((run / "latest").read_text().strip().removeprefix("global_step"))
    assert (run / f"global_step{step}" / "COMPLETE.json").is_file()
    assert {p.name for p in (run / f"global_step{step}").glob("rank*_state.pt")} == {"rank0_state.pt",
                                                                                     "rank1_state.pt"}
    assert f"stopped by a stop signal to another rank after step {step} of 100000: its state is saved in {run}" in err
    assert not (run / ".run.lock").exists()
    assert stop_seconds < 60
    run_cli(torchrun(*args(work, run, step + 2, "--load", run)), work)
    reference = work / "reference"
    run_cli(torchrun(*args(work, reference, step + 2)), work)
    resumed, straight = losses(run), losses(reference)
    assert [resumed[s] for s in (step + 1, step + 2)] == [straight[s] for s in (step + 1, step + 2)]
    assert [resumed[s] for s in range(1, step + 1)] == [straight[s] for s in range(1, step + 1)]


def test_sigterm_to_finetune_saves_its_state_and_the_same_command_continues_bit_equal(work):
    """A SIGTERM during step 3 of 6 of finetune.train: the job saves its training state (SAVE/checkpoint) at the
    step boundary and exits 0; the same command refuses other settings, then continues with the fp32 losses and
    the classifier of a run that never stopped, bit for bit (head dropout on: the RNG streams continue too), and
    removes the state. The run that never stopped, killed (kill -9) in its classifier's save: the same command
    replaces what it left."""
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:21]
    (work / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_cli([sys.executable, PRETRAIN, *args(work, work / "base", 1)], work)

    def finetune(save, steps=6, *extra):
        return [sys.executable, "-m", "finetune.train", "--base", work / "base", "--train", work / "dev.tsv",
                "--dev", work / "dev.tsv", "--train-steps", str(steps), "--eval-interval", "100000", "--log-interval",
                "1", "--max-length", "16", "--global-batch-size", "4", "--deepspeed_config", work / "ds.json",
                "--save", save, "--hf-export", "no", *extra]

    clf, reference = work / "clf", work / "clf_straight"
    stopped = run_cli(finetune(clf), work, env=cli_env(PIPELINE_SIGNAL_AT="3"))
    assert f"stopped by SIGTERM after step 3 of 6: its state is saved in {clf}" in stopped.stderr
    assert "rerun the same command to continue after step 3 of 6" in stopped.stderr
    assert (clf / "checkpoint" / "global_step3" / "COMPLETE.json").is_file() and not (clf / "classifier.json").exists()
    assert not (clf / ".run.lock").exists() and max(losses(clf)) == 3
    other = run_cli(finetune(clf, 6, "--lr", "1e-4"), work, check=False)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert f"error: --save {clf} holds an interrupted run with other settings (lr: 5e-05 then, 0.0001 now)" in \
        other.stderr
    resumed = run_cli(finetune(clf), work)
    assert f"continuing the interrupted run in {clf} after step 3" in resumed.stderr
    assert not (clf / "checkpoint").exists()
    # the run that never stopped is killed (kill -9) in its classifier's save, the weights written; the same
    # command again replaces what it left
    crashed = run_cli(finetune(reference), work, check=False,
                      env=cli_env(PIPELINE_CRASH_AT="before:classifier.json"))
    assert crashed.returncode == -9 and not (reference / "classifier.json").exists()
    assert losses(clf) == losses(reference) and sorted(losses(clf)) == list(range(1, 7))
    got, want = (read_state_dict(d / "model.safetensors") for d in (clf, reference))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (reference / ".run.lock").exists()
    rerun = run_cli(finetune(reference), work)
    assert "holds the outputs of an interrupted run of this job" in rerun.stderr
    assert (reference / "classifier.json").is_file() and losses(reference) == losses(clf)


def test_second_run_on_one_save_is_refused_and_a_dead_holder_is_taken_over(work):
    run = work / "locked"
    first = start([sys.executable, "-m", "pipeline.pretrain", *args(work, run, 100000)], work)
    wait_for(lambda: steps_logged(run) >= 1, what="the first run's first step")
    second = run_cli([sys.executable, "-m", "pipeline.pretrain", *args(work, run, 2)], work, check=False)
    lines = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert len(lines) == 1, second.stderr[-3000:]
    assert f"{run}/.run.lock: --save {run} is in use by another run (host " in lines[0]
    assert f"pid {first.pid}," in lines[0]
    first.send_signal(signal.SIGKILL)  # a crash: the lock file stays, its flock goes with the process
    first.communicate(timeout=60)
    assert (run / ".run.lock").exists()
    third = run_cli([sys.executable, "-m", "pipeline.pretrain", *args(work, run, 2)], work)
    assert "took over the lock of a run that ended (host " in third.stderr
    assert not (run / ".run.lock").exists()


def test_nan_loss_stops_without_saving_the_bad_state(work):
    """An fp32 run whose lr blows the weights up: step 1 is saved, steps 2 and 3 are NaN, the run stops at the
    second bad step (--max-bad-steps 2) naming both and the first gradient that went NaN, and latest still names
    step 1."""
    run = work / "diverged"
    proc = run_cli(torchrun(*args(work, run, 6, "--lr", "1e30", "--save-interval", "1", "--max-bad-steps", "2")),
                   work, check=False)
    assert proc.returncode != 0
    line = (f"error: step 3: the loss is nan, the first non-finite gradient: embedding.word_embeddings.weight (nan) "
            f"(2 step(s) with a non-finite loss or gradient: 2, 3; --max-bad-steps 2); the run "
            f"stopped without saving them (the last good checkpoint: {run}/global_step1)")
    assert line in proc.stderr, [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert (run / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in run.glob("global_step*")) == ["global_step1"]
    assert max(losses(run)) == 1  # no record of a bad step either


def test_dead_rank_ends_the_job_in_seconds_with_one_line(work):
    """SIGKILL to rank 1 mid-run: rank 0's next collective fails, it says so in one line and exits 1; torchrun's
    summary names rank 1 (exit code -9); the last complete checkpoint stays loadable."""
    run = work / "dead"
    proc = start(torchrun(*args(work, run, 100000, "--save-interval", "2", "--distributed-timeout-minutes", "1")),
                 work)
    wait_for(lambda: (run / "latest").is_file() and steps_logged(run) >= 4, what="a checkpoint and four steps")
    t0 = time.monotonic()
    worker(proc, 1).send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: step "), err[-3000:]
    assert "a collective failed: another rank died or did not answer" in lines[0]
    assert "[rank0]: Traceback" not in err
    assert "rank      : 1 (local_rank: 1)" in err and "exitcode  : -9" in err
    assert seconds < 20, f"{seconds:.1f} s from the kill to the end of the job"
    tag = (run / "latest").read_text().strip()
    assert f"the last good checkpoint: {run}/{tag}" in lines[0]
    run_cli(torchrun(*args(work, run, int(tag.removeprefix("global_step")) + 1, "--load", run)), work)
    print(f"dead rank: the job ended {seconds:.1f} s after the kill")


def test_stuck_rank_ends_the_job_within_the_distributed_timeout(work):
    """SIGSTOP to rank 1 (stuck, not dead: its sockets stay open): rank 0's next collective waits
    --distributed-timeout-minutes (here 0.2: 12 s), then rank 0 says so in one line and exits 1. torchrun would
    then give the stopped rank its 30 s SIGTERM grace before killing it; the test kills it itself once rank 0
    is gone (what that grace ends in), so the bound measured is the timeout's."""
    run, timeout_s = work / "stuck", 12.0
    proc = start(torchrun(*args(work, run, 100000, "--save-interval", "2",
                                "--distributed-timeout-minutes", str(timeout_s / 60))), work)
    wait_for(lambda: (run / "latest").is_file() and steps_logged(run) >= 3, what="a checkpoint and three steps",
             proc=proc)
    rank0, rank1 = worker(proc, 0), worker(proc, 1)
    t0 = time.monotonic()
    rank1.send_signal(signal.SIGSTOP)
    try:
        rank0.wait(timeout=timeout_s + 60)
        seconds = time.monotonic() - t0
    finally:
        rank1.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: step "), err[-3000:]
    assert "another rank died or did not answer within --distributed-timeout-minutes" in lines[0]
    assert "[rank0]: Traceback" not in err
    assert timeout_s <= seconds < timeout_s + 20, f"{seconds:.1f} s from SIGSTOP to rank 0's exit"
    assert f"the last good checkpoint: {run}/{(run / 'latest').read_text().strip()}" in lines[0]
    print(f"stuck rank: rank 0 ended {seconds:.1f} s after SIGSTOP (timeout {timeout_s:.0f} s)")
