"""Every config in ds_configs/ is accepted and trains the tiny GPT at a layout it is meant for (batch scaled down)."""
import json

import pytest

from conftest import ROOT
from dist import run_distributed
from engine_utils import train_worker

from pipeline.job.options import default_ds_config
from pipeline.job.model_configs import PRESETS

CASES = {  # config -> (world size, TP, PP, micro batch)
    "cpu.json": (2, 1, 1, 2),
    "fp16_zero1.json": (2, 1, 1, 2),
    "bf16_zero1.json": (2, 2, 1, 4),
    "bf16_zero2.json": (2, 1, 1, 2),
    "zero3.json": (2, 1, 1, 2),
    "pipeline_bf16_zero1.json": (2, 1, 2, 2),
}


def test_the_defaults_are_shipped_files():
    """The DeepSpeed config a job takes without --deepspeed_config, and the presets folder, are the project's."""
    assert default_ds_config() == str(ROOT / "ds_configs" / "cpu.json")
    assert PRESETS == ROOT / "models" / "configs" and (PRESETS / "gpt2-tiny.json").is_file()


def test_every_config_is_covered():
    assert sorted(p.name for p in (ROOT / "ds_configs").glob("*.json")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_trains(name):
    world, tp, pp, micro = CASES[name]
    ds = json.loads((ROOT / "ds_configs" / name).read_text())
    ds.pop("train_micro_batch_size_per_gpu")
    ds["train_batch_size"] = 8
    fp16 = ds.get("fp16", {}).get("enabled", False)
    results = run_distributed(train_worker, world, tp, pp, ds, None, 6, micro, "none", fp16)
    losses = results[-1]["loss"]
    print(name, losses, results[-1]["scale"])
    assert all(l == l for l in losses), "losses must be finite"
    assert losses[-1] < losses[0], losses
