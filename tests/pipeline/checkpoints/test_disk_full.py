"""A full disk, met as the process's file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with
EFBIG as a full disk fails with ENOSPC): one line naming the path and the bytes, the earlier checkpoints and
``latest`` untouched, the partial files removed; the same command without the limit then succeeds."""
import hashlib
import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli import cli_env, run_cli
from run_utils import ds_config, write_job_files

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
LIMIT = 100_000  # bytes a file may have: the model states (149 kB) and optimizer states (425 kB) do not fit


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def limited(cmd, cwd, limit=LIMIT):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=600, preexec_fn=_file_size_limit(limit))


def one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk_full")
    write_job_files(d, MODEL, json.__doc__ * 10)
    (d / "ds_z2.json").write_text(json.dumps(ds_config(stage=2)))
    run_cli([sys.executable, *pretrain(d, 2, "--save-interval", "1")], d)
    return d


def pretrain(d, steps, *extra):
    return ["-m", "pipeline.pretrain", "--model-config", d / "model.json", "--deepspeed_config", d / "ds.json",
            "--data", d / "corpus.txt", "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1",
            "--train-steps", str(steps), "--cache-dir", d / "cache", "--save", d / "run", *extra]


def test_checkpoint_save_that_does_not_fit(work):
    run = work / "run"
    before = tree(run)
    proc = limited([sys.executable, *pretrain(work, 3, "--load", run)], work)
    line = one_line(proc)
    assert line.startswith(f"error: {run}/global_step3: a file reached the process's file-size limit (ulimit -f) "
                           f"while writing the checkpoint of step 3 (it needs about ")
    needed = sum(p.stat().st_size for p in (run / "global_step2").iterdir())
    assert f"it needs about {needed} bytes" in line
    assert (run / "latest").read_text() == "global_step2\n"
    assert not (run / "global_step3").exists()
    after = tree(run)
    ours = ("metrics.jsonl", "args.json", "ds_config.json")  # the resumed run's own records (docs/runs.md)
    assert {k: v for k, v in after.items() if k not in ours} == {k: v for k, v in before.items() if k not in ours}
    run_cli([sys.executable, *pretrain(work, 3, "--load", run)], work)  # the same command, with room
    assert (run / "latest").read_text() == "global_step3\n"


# import_hf reads the export_hf case's output (its model.safetensors, ~140 kB, does not fit either)
SOURCES = {"export_hf": ("--checkpoint", "run"), "reshard": ("--checkpoint", "run"),
           "import_hf": ("--model", "out_export_hf")}


@pytest.mark.parametrize("command", list(SOURCES))
def test_output_that_does_not_fit(work, command):
    out = work / f"out_{command}"
    flag, source = SOURCES[command]
    argv = [sys.executable, "-m", f"pipeline.{command}", flag, work / source, "--out", out]
    if not (work / source).exists():  # import_hf run alone
        run_cli([sys.executable, "-m", "pipeline.export_hf", "--checkpoint", work / "run", "--out", work / source], work)
    line = one_line(limited(argv, work))
    assert line.startswith(f"error: {out}: a file reached the process's file-size limit (ulimit -f)")
    assert "the partial files are removed" in line
    assert not out.exists()
    assert not [p.name for p in work.iterdir() if p.name.startswith(f".{out.name}")]  # no temporary left
    run_cli(argv, work)
    assert out.is_dir()


def test_universal_conversion_inside_load_that_does_not_fit(work):
    """--load at another ZeRO stage converts the run's checkpoint into SAVE/universal/<tag> first (never into the
    run it reads): at a file-size limit below one parameter's fp32 file (the embedding's 33 kB) the conversion fails
    in one line, leaves no cache and no temporary beside it, and the same command with room converts, trains and
    saves."""
    run, save = work / "run", work / "zero2"
    tag = (run / "latest").read_text().strip()
    cache, step = save / "universal" / tag, int(tag.removeprefix("global_step")) + 1
    argv = [sys.executable, *pretrain(work, step, "--load", run), "--deepspeed_config", work / "ds_z2.json",
            "--save", save]
    line = one_line(limited(argv, work, limit=20_000))
    assert line.startswith(f"error: {cache}: a file reached the process's file-size limit (ulimit -f)"), line
    assert not cache.exists() and not list(cache.parent.glob(f".{tag}*"))
    run_cli(argv, work)
    assert (save / "latest").read_text() == f"global_step{step}\n" and cache.is_dir()
