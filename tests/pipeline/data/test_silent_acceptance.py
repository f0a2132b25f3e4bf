"""Nothing is silently accepted: misspelled DeepSpeed keys, non-finite data weights, null texts, partial labels."""
import json

import pytest
from conftest import ROOT, shared_data

from finetune.data import read_texts
from pipeline.data.build import parse_weights
from pipeline.data.sources import DataSourceError, load_documents, resolve
from pipeline.engine.ds_keys import unknown_key_errors
from pipeline.engine.ds_config import EngineConfigError, resolve_ds_config

BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("extra,message", [
    ({"train_batch_sise": 8}, "unknown DeepSpeed config key 'train_batch_sise'; did you mean 'train_batch_size'?"),
    ({"zero_optimisation": {"stage": 1}}, "'zero_optimisation'; did you mean 'zero_optimization'?"),
    ({"zero_optimization": {"stgae": 1}}, "'zero_optimization.stgae'; did you mean 'stage'?"),
    ({"bf16": {"enabeld": True}}, "'bf16.enabeld'; did you mean 'enabled'?"),
    ({"optimizer": {"type": "AdamW", "parms": {}}}, "'optimizer.parms'; did you mean 'params'?"),
    ({"peak_tflops": 989}, "peak_tflops is not a DeepSpeed key; pass --peak-tflops"),
])
def test_unknown_deepspeed_keys_are_refused(extra, message):
    with pytest.raises(EngineConfigError, match="^ds.json: .*" + message.replace("?", r"\?")):
        resolve_ds_config({**BASE, **extra}, data_parallel=1, source="ds.json")


def test_shipped_configs_hold_deepspeed_keys_only():
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        ds = json.loads(path.read_text())
        assert unknown_key_errors(ds, str(path)) == []
        assert "peak_tflops" not in ds


def test_every_deepspeed_key_of_its_own_docs_is_known():
    """Keys DeepSpeed documents and reads are not refused (the check must not reject a valid config)."""
    ds = {**BASE, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10,
          "wall_clock_breakdown": False, "gradient_clipping": 1.0, "prescale_gradients": False,
          "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                   "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": False},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                                "offload_optimizer": {"device": "cpu"}},
          "activation_checkpointing": {"partition_activations": False}, "tensorboard": {"enabled": False},
          "csv_monitor": {"enabled": False}, "wandb": {"enabled": False}, "flops_profiler": {"enabled": False},
          "checkpoint": {"load_universal": False}, "data_types": {"grad_accum_dtype": "fp32"},
          "communication_data_type": "fp32", "zero_allow_untested_optimizer": True, "comms_logger": {"enabled": False},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    assert unknown_key_errors(ds) == []


def test_data_weights_must_be_finite(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("some text\n")
    sources = resolve([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert parse_weights("1,3", sources) == [0.25, 0.75]
    for bad in ("nan,1", "inf,1", "1,x", "-1,2", "0,0"):
        with pytest.raises(DataSourceError, match=f"--data-weights {bad}: each weight must be a finite number"):
            parse_weights(bad, sources)
    with pytest.raises(DataSourceError, match="1 weights for 2 data sources"):
        parse_weights("1", sources)


def test_null_text_is_refused(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ("one", "two", None, "four")) + "\n")
    with pytest.raises(DataSourceError, match=rf"{path}: record 3 has a null 'text' field"):
        load_documents(resolve(str(path))[0], cache_dir=str(tmp_path / "cache"))


def test_partial_label_columns_are_reported(tmp_path, capsys):
    """finetune.predict on a file holding some but not all of the model's labels says it reads it unlabelled."""
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:6]
    header = lines[0].split("\t")
    keep = header[:2] + header[2:5]  # ID, Tweet and three of the eleven emotions
    (tmp_path / "partial.tsv").write_text("\n".join("\t".join(l.split("\t")[:5]) for l in lines) + "\n")
    data = read_texts(str(tmp_path / "partial.tsv"), header[2:], None, None)
    assert data.labels is None and len(data) == 5
    err = capsys.readouterr().err
    assert f"{tmp_path / 'partial.tsv'}: has the label column(s) {', '.join(keep[2:])} but not" in err
    assert "read as unlabelled" in err
    data = read_texts(str(shared_data("semeval2018-ec") / "dev.tsv"), header[2:], None, None)
    assert data.labels is not None and capsys.readouterr().err == ""
