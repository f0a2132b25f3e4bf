"""A wheel works as the editable install does: built with ``pip wheel .`` and installed into a folder of its own, it
finds its DeepSpeed configs and model presets (package data, next to the packages, not paths into a source tree)
and resolves the main job's configuration from a directory outside the checkout."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESOLVE = """
import json, sys
import pipeline
from pipeline.engine.ds_config import load_ds_config
from pipeline.job.model_configs import choose_model_config, presets
from pipeline.job.options import default_ds_config
from pipeline.pretrain import parse_args
assert pipeline.__file__.startswith(sys.argv[1]), pipeline.__file__  # the wheel's code, not the checkout's
args = parse_args(["--model-config", "gpt2-tiny", "--data", "corpus.txt"])
config, family = choose_model_config(args.model_config, args.model_type, None)
ds = load_ds_config(default_ds_config())
print(json.dumps({"presets": presets(), "hidden_size": config["hidden_size"], "family": family.name,
                  "micro_batch": ds["train_micro_batch_size_per_gpu"], "ds": default_ds_config()}))
"""


def test_a_wheel_finds_its_configs_outside_the_checkout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "ds_configs/cpu.json" in names and "models/configs/gpt2-tiny.json" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, cwd=tmp_path)
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(site)], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert "gpt2-tiny" in resolved["presets"] and resolved["hidden_size"] > 0 and resolved["family"] == "gpt"
    assert resolved["ds"].startswith(str(site)) and resolved["micro_batch"] >= 1
