"""A real full disk: a small tmpfs mounted inside the test (root only; skipped where mount is refused), the
outputs written onto it until ENOSPC. Each case is one line naming the path, the bytes needed and free, exit code 1,
and nothing partial left on the file system: no tag without its manifest, no temporary, ``latest`` as it was.
(tests/pipeline/checkpoints/test_disk_full.py meets the same paths through the file-size limit, EFBIG.)"""
import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
from cli import run_cli
from forked_cli import run_forked
from run_utils import ds_config, write_job_files

from pipeline.job.files import tree_size

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}


def pretrain(d, save, steps, *extra):
    return ["--model-config", d / "model.json", "--deepspeed_config", d / "ds.json", "--data", d / "corpus.txt",
            "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1", "--train-steps", str(steps),
            "--cache-dir", d / "cache", "--save", save, *extra]


@contextlib.contextmanager
def tmpfs(path, size: int):
    """A tmpfs of ``size`` bytes (rounded up to pages) at ``path``, unmounted afterwards."""
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    d = tmp_path_factory.mktemp("enospc")
    write_job_files(d, MODEL, json.__doc__ * 10)
    (d / "ds_z2.json").write_text(json.dumps(ds_config(stage=2)))
    run_cli([sys.executable, "-m", "pipeline.pretrain", *pretrain(d, d / "run", 2, "--save-interval", "1")], d)
    run_cli([sys.executable, "-m", "pipeline.export_hf", "--checkpoint", d / "run", "--out", d / "hf"], d)
    return d


def leftovers(root) -> list[str]:
    """Temporaries (``.name.tmp...``, ``.name.old-...``) and tags without COMPLETE.json under ``root``."""
    found = [str(p) for p in root.rglob(".*") if ".tmp" in p.name or ".old-" in p.name]
    return found + [str(p) for p in root.rglob("global_step*") if p.is_dir() and not (p / "COMPLETE.json").is_file()]


def test_enospc(work):
    d = work
    tag_bytes = tree_size(d / "run" / "global_step1")
    with contextlib.ExitStack() as mounts:
        save = mounts.enter_context(tmpfs(d / "m_save", int(1.6 * tag_bytes))) / "run"  # one tag fits, not two
        async_save = mounts.enter_context(tmpfs(d / "m_async", int(1.6 * tag_bytes))) / "run"
        small = {name: mounts.enter_context(tmpfs(d / f"m_{name}", 64 * 1024)) for name in ("export", "import",
                                                                                              "reshard")}
        # the conversion goes into the resuming run's --save (never into the run it reads): no room for it there
        universal = mounts.enter_context(tmpfs(d / "m_universal", 64 * 1024))
        tag = (d / "run" / "latest").read_text().strip()
        cases = [
            ("save", ("pipeline.pretrain", pretrain(d, save, 2, "--save-interval", "1")),
             f"error: {save}/global_step2: no space left on the device while writing the checkpoint of step 2 (it "
             f"needs about {tag_bytes} bytes, "),
            # the write of step 2 fails in the background; the line comes at the next step boundary
            ("async save", ("pipeline.pretrain", pretrain(d, async_save, 3, "--save-interval", "1", "--async-save")),
             f"error: {async_save}/global_step2: no space left on the device while writing the checkpoint of step 2 "
             f"(it needs about {tag_bytes} bytes, "),
            ("export", ("pipeline.export_hf", ["--checkpoint", d / "run", "--out", small["export"] / "hf"]),
             f"error: {small['export']}/hf: no space left on the device while writing the output directory"),
            ("import", ("pipeline.import_hf", ["--model", d / "hf", "--out", small["import"] / "model"]),
             f"error: {small['import']}/model: no space left on the device while writing the output directory"),
            ("reshard", ("pipeline.reshard", ["--checkpoint", d / "run", "--out", small["reshard"] / "tp2"]),
             f"error: {small['reshard']}/tp2: no space left on the device while writing the output directory"),
            ("universal", ("pipeline.pretrain", [*pretrain(d, universal / "zero2", 3, "--load", d / "run"),
                                                 "--deepspeed_config", d / "ds_z2.json"]),
             f"error: {universal}/zero2/universal/{tag}: no space left on the device while writing"),
        ]
        results = run_forked([argv for _, argv, _ in cases], d)
        for (name, _, start), (code, _, err) in zip(cases, results):
            lines = [x for x in err.splitlines() if x.startswith("error: ")]
            print(f"{name}: exit {code}: {lines}")
            assert code == 1 and "Traceback" not in err and len(lines) == 1, f"{name}: exit {code}\n{err[-3000:]}"
            assert lines[0].startswith(start), f"{name}: {lines[0]}"
            assert re.search(r"\d+ (bytes )?are free there", lines[0]) and "partial files are removed" in lines[0]
        for run in (save, async_save):
            assert (run / "latest").read_text() == "global_step1\n" and not (run / "global_step2").exists()
            assert not (run / "global_step3").exists()
        assert all(not any(m.iterdir()) for m in small.values())  # nothing of the outputs, no temporary
        assert not (universal / "zero2" / "universal" / tag).exists()
        for root in (save, async_save, universal):
            assert not leftovers(root), leftovers(root)
