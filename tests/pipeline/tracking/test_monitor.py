"""Experiment tracking through DeepSpeed's monitor: the tensorboard, csv_monitor and wandb (offline) sections of
a DeepSpeed config receive the jobs' metrics on rank 0 with the optimizer step as x-axis. Read back with
TensorBoard's own reader, the CSV files and the W&B offline run file."""
import csv
import json
import struct
from pathlib import Path

import pytest
from conftest import shared_data
from dist import run_distributed
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from test_finetune_train import ec_slice, write_base
from test_pretrain import FP32_DS, corpus, job_args, metrics  # noqa: F401 (corpus is a fixture)
from wandb.proto import wandb_internal_pb2 as pb

MONITOR = {"tensorboard": {"enabled": True, "job_name": "tiny"}, "csv_monitor": {"enabled": True, "job_name": "tiny"}}


def scalars(log_dir: Path) -> dict:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def csv_rows(path: Path) -> tuple[list, list]:
    rows = list(csv.reader(path.read_text().splitlines()))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def wandb_records(run_file: Path):
    """The protobuf Records of a W&B offline run file: a LevelDB-style log (32 KiB blocks, 7-byte record headers)
    after a 7-byte file header."""
    data, pos, block, chunks = run_file.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks = data[pos + 7:pos + 7 + length] if kind in (1, 2) else chunks + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            yield record


def wandb_history(run_file: Path) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]


def wandb_config(run_file: Path) -> dict:
    return {i.key: json.loads(i.value_json) for r in wandb_records(run_file) if r.WhichOneof("record_type") == "config"
            for i in r.config.update}


def tensorboard_hparams(log_dir: Path) -> dict:
    """The hparams of the run's session (TensorBoard's hparams plugin), as written by ``MetricsWriter.log_settings``."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    values = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for key, value in data.session_start_info.hparams.items():
            values[key] = getattr(value, value.WhichOneof("kind"))
    return values


def _pretrain(rank, argv):
    from pipeline.pretrain import main
    return main(argv)


def test_pretraining_metrics_reach_tensorboard_csv_and_wandb_on_rank_0(tmp_path, corpus):  # noqa: F811
    pytest.importorskip("wandb")
    save = tmp_path / "run"
    ds = {**FP32_DS, **MONITOR, "wandb": {"enabled": True, "project": "tiny"}}
    argv = job_args(tmp_path, corpus, "--train-steps", "6", "--eval-interval", "3", "--eval-iters", "1",
                    "--peak-tflops", "1.0", "--save", str(save), ds=ds)
    run_distributed(_pretrain, 2, argv, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    logged = [r for r in metrics(save) if "loss" in r]
    valid = [r for r in metrics(save) if "valid_loss" in r]

    events = list((save / "tensorboard" / "tiny").glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # rank 0 only
    tb = scalars(save / "tensorboard" / "tiny")
    for key in ("loss", "lr", "grad_norm", "skipped_steps", "tokens_per_s", "tflops_per_device", "mfu"):
        assert [s for s, _ in tb[f"pretrain/{key}"]] == [r["step"] for r in logged], key
        assert [v for _, v in tb[f"pretrain/{key}"]] == pytest.approx([r[key] for r in logged], rel=1e-6), key
    assert [s for s, _ in tb["pretrain/valid_loss"]] == [3, 6]
    assert [v for _, v in tb["pretrain/valid_perplexity"]] == pytest.approx(
        [2.718281828459045 ** r["valid_loss"] for r in valid], rel=1e-5)
    assert "Train/Samples/lr" in tb  # DeepSpeed's own events share the writer

    header, rows = csv_rows(save / "csv_monitor" / "tiny" / "pretrain_loss.csv")
    assert header == ["step", "loss"]
    assert rows == [(r["step"], pytest.approx(r["loss"], rel=1e-12)) for r in logged]

    runs = list((save / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history = [h for h in wandb_history(runs[0]) if "pretrain/loss" in h]
    assert [h["pretrain/step"] for h in history] == [r["step"] for r in logged]
    assert [h["pretrain/loss"] for h in history] == pytest.approx([r["loss"] for r in logged], rel=1e-12)
    # the resolved settings (args.json, ds_config.json) as TensorBoard's hparams and W&B's config
    hparams = tensorboard_hparams(save / "tensorboard" / "tiny")
    assert (hparams["args/train_steps"], hparams["args/save"]) == (6, str(save))
    assert hparams["ds/train_batch_size"] == json.loads((save / "ds_config.json").read_text())["train_batch_size"]
    config = wandb_config(runs[0])
    assert (config["args/train_steps"], config["ds/zero_optimization.stage"]) == (6, FP32_DS["zero_optimization"]["stage"])


def _finetune(rank, argv):
    from finetune.train import main
    main(argv)


def test_finetuning_dev_scores_reach_tensorboard_and_csv(tmp_path):
    ec = shared_data("semeval2018-ec")
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "steps_per_print": 10**9, **MONITOR}))
    save = tmp_path / "run"
    argv = ["--base", str(write_base(tmp_path / "base", hidden_size=32, num_layers=1)),
            "--train", str(ec_slice(ec / "train.tsv", tmp_path / "train.tsv", 64)),
            "--dev", str(ec_slice(ec / "dev.tsv", tmp_path / "dev.tsv", 32)),
            "--deepspeed_config", str(tmp_path / "ds.json"), "--train-steps", "4", "--eval-interval", "2",
            "--max-length", "24", "--log-interval", "1", "--hf-export", "no", "--save", str(save)]
    run_distributed(_finetune, 1, argv)
    records = metrics(save)
    tb = scalars(save / "tensorboard" / "tiny")
    for key in ("dev_micro_f1", "dev_macro_f1", "dev_jaccard"):
        scored = [r for r in records if key in r]
        assert [r["step"] for r in scored] == [2, 4], key  # every --eval-interval, and the last step
        assert tb[f"finetune/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in scored], key
    assert [s for s, _ in tb["finetune/dev_tuned_macro_f1"]] == [4]
    assert [s for s, _ in tb["finetune/loss"]] == [1, 2, 3, 4]
    header, rows = csv_rows(save / "csv_monitor" / "tiny" / "finetune_dev_jaccard.csv")
    assert header == ["step", "dev_jaccard"] and [s for s, _ in rows] == [2, 4]
