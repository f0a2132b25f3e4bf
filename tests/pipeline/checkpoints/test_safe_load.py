"""No code runs from a checkpoint; doctored checkpoints are refused, naming the file.

Real malicious pickles: a real DeepSpeed checkpoint file with the real weights plus an object whose
unpickling writes a marker file. The attacker also fixes up COMPLETE.json (sizes and sha256), so
only the weights-only loading stands between the file and the payload. Every command that reads a
checkpoint is tried on it: the marker never appears and the command fails naming the file.
"""
import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cli import cli_env, run_cli
from conftest import shared_data
from dist import run_distributed

from pipeline.checkpoints import checkpoint, recovery_script, safe_load, universal
from pipeline.pretrain import main
from pipeline.checkpoints.reshard import reshard

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}


def _ds(stage):
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}


class Payload:
    """Unpickling this runs ``exec``: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def _pretrain(rank, argv):
    main(argv)
    return 0


def pretrain_args(d, save, stage, steps=2, *extra):
    return ["--model-config", str(d / "model.json"), "--deepspeed_config", str(d / f"ds_z{stage}.json"),
            "--data", str(d / "corpus.txt"), "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1",
            "--train-steps", str(steps), "--cache-dir", str(d / "cache"), "--save", str(save), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real one-process runs saved at steps 1 and 2: ZeRO-1 (model + optimizer files) and ZeRO-3."""
    d = tmp_path_factory.mktemp("trust")
    (d / "corpus.txt").write_text(inspect.getsource(json) + inspect.getsource(inspect))
    (d / "model.json").write_text(json.dumps(MODEL))
    for stage in (1, 3):
        (d / f"ds_z{stage}.json").write_text(json.dumps(_ds(stage)))
        run_distributed(_pretrain, 1, pretrain_args(d, d / f"z{stage}", stage, 2, "--save-interval", "1"))
    return d


def doctored_copy(src: Path, dst: Path, victim: str, marker: Path, tag: str = "global_step2") -> Path:
    """A copy of run ``src`` whose ``tag/victim`` carries its real contents plus a payload; COMPLETE.json agrees."""
    shutil.copytree(src, dst)
    path = dst / tag / victim
    state = torch.load(path, weights_only=True, map_location="cpu")
    state["payload"] = Payload(marker)
    torch.save(state, path)
    manifest = json.loads((dst / tag / checkpoint.COMPLETE).read_text())
    manifest["files"][victim] = {"size": path.stat().st_size, "sha256": safe_load.sha256_file(path)}
    (dst / tag / checkpoint.COMPLETE).write_text(json.dumps(manifest))
    return path


def run_cmd(args, cwd, timeout=600):
    return run_cli([sys.executable, *args], cwd, timeout=timeout, check=False)


def test_payload_is_live(runs, tmp_path):
    """The doctored file really runs its payload when unpickled as DeepSpeed's own engine does."""
    marker = tmp_path / "marker"
    path = doctored_copy(runs / "z1", tmp_path / "run", "mp_rank_00_model_states.pt", marker)
    proc = run_cmd(["-c", f"import torch; torch.load({str(path)!r}, weights_only=False)"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "code ran"


def _ec_files(d: Path) -> tuple[Path, Path]:
    ec = shared_data("semeval2018-ec")
    out = []
    for name, n in (("train.tsv", 40), ("dev.tsv", 20)):
        lines = (ec / name).read_text(encoding="utf-8").splitlines()[:n + 1]
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        out.append(d / name)
    return tuple(out)


COMMANDS = {
    "pretrain --load": lambda d, run, out: ["-m", "pipeline.pretrain", *pretrain_args(d, out, 1, 3, "--load",
                                                                                     str(run))],
    "export_hf": lambda d, run, out: ["-m", "pipeline.export_hf", "--checkpoint", str(run), "--out", str(out)],
    "pretrain --load at another ZeRO stage": lambda d, run, out: ["-m", "pipeline.pretrain",
                                                                  *pretrain_args(d, out, 3, 3, "--load", str(run))],
    "reshard": lambda d, run, out: ["-m", "pipeline.reshard", "--checkpoint", str(run), "--out", str(out)],
    "evaluate --checkpoint": lambda d, run, out: ["-m", "pipeline.evaluate", "--task", "bpc", "--data",
                                                  str(d / "corpus.txt"), "--checkpoint", str(run), "--out",
                                                  str(out), "--max-examples", "2", "--no-progress"],
    "finetune.train --base": lambda d, run, out: ["-m", "finetune.train", "--base", str(run), "--train",
                                                  str(_ec_files(d)[0]), "--dev", str(_ec_files(d)[1]),
                                                  "--epochs", "1", "--save", str(out)],
}
CASES = [("pretrain --load", 1, "mp_rank_00_model_states.pt"),
         ("pretrain --load", 1, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
         ("pretrain --load at another ZeRO stage", 1, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
         ("reshard", 1, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
         ("export_hf", 1, "mp_rank_00_model_states.pt"),
         ("export_hf", 3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
         ("evaluate --checkpoint", 3, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
         ("finetune.train --base", 3, "zero_pp_rank_0_mp_rank_00_optim_states.pt")]


@pytest.mark.parametrize("command,stage,victim", CASES)
def test_malicious_checkpoint_never_runs(runs, tmp_path, command, stage, victim):
    marker = tmp_path / "marker"
    path = doctored_copy(runs / f"z{stage}", tmp_path / "run", victim, marker)
    proc = run_cmd(COMMANDS[command](runs, tmp_path / "run", tmp_path / "out"), tmp_path)
    assert not marker.exists(), f"{command}: the payload ran"
    assert proc.returncode != 0
    assert f"{path}: contains a pickled object of type builtins.exec, not allowed" in proc.stderr
    assert "weights_only=False" not in proc.stderr  # never torch's advice to load it unsafely


def test_copied_recovery_script_is_safe(runs, tmp_path):
    """The zero_to_fp32.py in a run directory (the project's: pipeline/checkpoints/recovery_script.py) refuses a
    doctored file without running it; on a clean run it recovers the weights."""
    script = runs / "z3" / recovery_script.SCRIPT_NAME
    assert script.read_text() == recovery_script.script_text()
    marker = tmp_path / "marker"
    doctored_copy(runs / "z3", tmp_path / "run", "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    proc = run_cmd([str(tmp_path / "run" / recovery_script.SCRIPT_NAME), str(tmp_path / "run"), str(tmp_path / "o")],
                   tmp_path)
    assert proc.returncode != 0 and not marker.exists()
    assert "builtins.exec" in proc.stderr
    proc = run_cmd([str(script), str(runs / "z3"), str(tmp_path / "clean")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "clean").iterdir())


def test_importing_the_library_sets_no_environment_variable(tmp_path):
    """models, pipeline and finetune (every package and the job modules a command defers to) leave ``os.environ``
    as they found it: what a command sets for its process (``THP_MEM_ALLOC_ENABLE``) is set when it starts. The
    libraries they use are imported first: torch and scikit-learn set OpenMP and inductor variables of their own."""
    code = ("import torch, torch._inductor.config, deepspeed, transformers, datasets, peft, trl, sklearn, os\n"
            "before = dict(os.environ)\n"
            "import models, pipeline, finetune, pipeline.pretraining, pipeline.checkpoints.checkpoint, finetune.job.run\n"
            "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
            "assert not changed, f'the import changed {changed}'")
    env = {k: v for k, v in cli_env().items() if k != "THP_MEM_ALLOC_ENABLE"}
    proc = run_cli([sys.executable, "-c", code], tmp_path, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_library_loads_are_weights_only(runs, tmp_path):
    """Importing the library sets no environment variable; inside ``weights_only_loads()`` DeepSpeed's zero_to_fp32,
    called directly past our checks, cannot run the payload (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD), and after it
    the environment is what it was."""
    marker = tmp_path / "marker"
    doctored_copy(runs / "z3", tmp_path / "run", "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    code = ("import os; before = dict(os.environ); import pipeline.checkpoints.checkpoint as c; "
            "assert dict(os.environ) == before, 'the import changed the environment'; "
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g\n"
            "try:\n"
            f"    with c.safe_load.weights_only_loads(): g({str(tmp_path / 'run')!r})\n"
            "finally:\n"
            "    assert dict(os.environ) == before, 'the environment was not restored'")
    proc = run_cmd(["-c", code], tmp_path)
    assert proc.returncode != 0 and not marker.exists()
    assert "UnpicklingError" in proc.stderr and "AssertionError" not in proc.stderr, proc.stderr[-2000:]


def test_checkpoint_engine_refuses_legacy_format_pickle(tmp_path):
    """A file in torch's old (non-zip) format, which the opcode scan cannot read: the weights-only load refuses it."""
    marker = tmp_path / "marker"
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": Payload(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(safe_load.UnsafeCheckpointError, match=rf"{path}: contains a pickled object of type "
                                                              r"builtins.exec, not allowed"):
        safe_load.SafeCheckpointEngine().load(str(path))
    assert not marker.exists()


def test_sha256_catches_same_size_damage(runs, tmp_path):
    """64 zeroed bytes in a model-states file (same size): refused, naming the file."""
    shutil.copytree(runs / "z1", tmp_path / "run")
    victim = tmp_path / "run" / "global_step2" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[-2000:-1936] = bytes(64)
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=rf"{victim} does not match the sha256"):
        checkpoint.resolve_tag(tmp_path / "run")
    manifest = json.loads((runs / "z1" / "global_step2" / checkpoint.COMPLETE).read_text())
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert checkpoint.resolve_tag(runs / "z1") == "global_step2"


@pytest.mark.parametrize("tag", ["../other/global_step2", "/tmp", "..", "global_step2/../../other/global_step2"])
def test_tag_outside_the_run_is_refused(runs, tmp_path, tag):
    shutil.copytree(runs / "z1", tmp_path / "other")
    shutil.copytree(runs / "z1", tmp_path / "run")
    (tmp_path / "run" / "latest").write_text(tag + "\n")
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint directory inside"):
        checkpoint.resolve_tag(tmp_path / "run")
    with pytest.raises(checkpoint.CheckpointError, match="--load-tag tag"):
        checkpoint.resolve_tag(tmp_path / "run", tag)


def test_universal_conversion_scans_its_source(runs, tmp_path):
    """ds_to_universal unpickles every file of a tag with weights_only=False: the conversion itself scans them
    first (even when called without checkpoint.resolve_tag before it) and refuses, naming the file."""
    marker = tmp_path / "marker"
    path = doctored_copy(runs / "z1", tmp_path / "run", "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(safe_load.UnsafeCheckpointError, match=rf"{path}: contains a pickled object of type "
                                                              r"builtins.exec, not allowed"):
        universal.ensure_cache(tmp_path / "run", "global_step2", log=lambda *_: None)
    assert not marker.exists()


def _doctor_cache_file(cache: Path, name: str, marker: Path) -> Path:
    """A cache file replaced by a pickle with a payload; the cache's manifest fixed up to match it."""
    path = cache / name
    torch.save({"tensor": torch.load(path, weights_only=True), "payload": Payload(marker)}, path)
    manifest = json.loads((cache / universal.MANIFEST).read_text())
    manifest["files"][name] = {"size": path.stat().st_size, "sha256": safe_load.sha256_file(path)}
    (cache / universal.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_universal_cache_is_verified_and_scanned(runs, tmp_path):
    """The cache records a sha256 of each file: a same-size change is rebuilt; a doctored file whose manifest
    was fixed up too is refused, naming it, before DeepSpeed loads anything."""
    shutil.copytree(runs / "z1", tmp_path / "run")
    messages = []
    cache = universal.ensure_cache(tmp_path / "run", "global_step2", log=messages.append)
    manifest = json.loads((cache / universal.MANIFEST).read_text())
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    victim = next(cache.glob("zero/*/exp_avg.pt"))
    data = bytearray(victim.read_bytes())
    data[-200:-136] = bytes(64)
    victim.write_bytes(bytes(data))
    assert universal.ensure_cache(tmp_path / "run", "global_step2", log=messages.append) == cache
    assert "does not match its sha256" in messages[-1] and "rebuilding" in messages[-1]
    marker = tmp_path / "marker"
    path = _doctor_cache_file(cache, str(victim.relative_to(cache)), marker)
    with pytest.raises(safe_load.UnsafeCheckpointError, match=rf"{path}: contains a pickled object of type "
                                                              r"builtins.exec, not allowed"):
        universal.ensure_cache(tmp_path / "run", "global_step2", log=messages.append)
    assert not marker.exists()


def test_resharded_run_records_sha256(runs, tmp_path):
    """pipeline.reshard's output is verified like any run: its tag's COMPLETE.json holds every file's sha256."""
    out = reshard(runs / "z1", tmp_path / "resharded")
    manifest = json.loads((out / "global_step2" / checkpoint.COMPLETE).read_text())
    assert sorted(manifest["files"]) == ["layout.json", "rank0_state.pt"]
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert checkpoint.resolve_tag(out) == "global_step2"
    state = out / "global_step2" / "rank0_state.pt"
    state.write_bytes(state.read_bytes()[:-64] + bytes(64))
    with pytest.raises(checkpoint.CheckpointError, match=rf"{state} does not match the sha256"):
        checkpoint.resolve_tag(out)
