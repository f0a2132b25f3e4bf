"""One run per directory, through the command line (docs/runs.md): a run killed after its checkpoint of step 2 is
run again with the same --save and resumes there (one metrics.jsonl series, the LR schedule continued, changed
settings reported, a summary at the end); --no-resume refuses the directory; a --config file overridden by flags,
its unknown keys refused; Hugging Face-style "auto" DeepSpeed configs filled or refused. All command lines in one
Python start (tests/forked_cli.py)."""
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from cli import cli_env
from forked_cli import run_forked
from run_utils import ds_config
from test_pretrain import MODEL, corpus  # noqa: F401 (a fixture)

from pipeline.engine.schedules import LRSchedule, Scheduler
from pipeline.job.config_file import ConfigFileError
from pipeline.pretrain import parse_args

LR = {"lr": 1e-2, "min_lr": 1e-3, "warmup": 1}


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    d = tmp_path_factory.mktemp("runs")
    (d / "model.json").write_text(json.dumps(MODEL))
    ds = ds_config(stage=1)
    (d / "ds.json").write_text(json.dumps(ds))
    auto = {**ds, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {**ds["optimizer"], "params": {**ds["optimizer"]["params"], "lr": "auto",
                                                        "weight_decay": "auto"}}}
    (d / "auto.json").write_text(json.dumps(auto))
    (d / "job.yaml").write_text(yaml.safe_dump({
        "model_config": str(d / "model.json"), "deepspeed_config": str(d / "ds.json"), "data": [str(corpus)],
        "tokenizer": "bytes", "seq_length": 32, "train_steps": 4, "lr": LR["lr"], "min-lr": LR["min_lr"],
        "lr_warmup_steps": LR["warmup"], "lr_decay_style": "linear", "eval_interval": 2, "eval_iters": 1,
        "save_interval": 2, "cache_dir": str(d / "cache")}))
    (d / "typo.toml").write_text('train_stepz = 3\n')
    run, fresh = d / "run", d / "fresh"
    job = ["--config", str(d / "job.yaml")]
    plain = ["--model-config", d / "model.json", "--deepspeed_config", d / "auto.json", "--data", corpus,
             "--tokenizer", "bytes", "--seq-length", "32", "--cache-dir", d / "cache"]
    cases = [
        ("pipeline.pretrain", [*job, "--train-steps", "3", "--save", run]),  # killed saving step 3
        ("pipeline.pretrain", [*job, "--train-steps", "5", "--save", run]),  # the same command, 2 more steps
        ("pipeline.pretrain", [*job, "--save", run, "--no-resume"]),
        ("pipeline.pretrain", ["--config", d / "typo.toml"]),
        ("pipeline.export_hf", ["--config", d / "typo.toml"]),
        ("pipeline.pretrain", [*job, "--deepspeed_config", d / "auto.json", "--micro-batch-size", "1",
                               "--global-batch-size", "2", "--lr", "2e-3", "--train-steps", "1", "--save", fresh]),
        ("pipeline.pretrain", [*plain, "--micro-batch-size", "1"]),
        ("pipeline.pretrain", [*plain, "--lr", "1e-3"]),
    ]
    # the first command is killed (SIGKILL) once the DeepSpeed files of step 3 are written, before COMPLETE.json
    return d, run_forked(cases, d, env=cli_env(PIPELINE_CRASH_AT="after-deepspeed-files:3"))


def test_the_same_command_resumes_its_run_as_one_series(runs):
    d, results = runs
    run = d / "run"
    (killed, _, _), (code, out, err) = results[0], results[1]
    assert killed == -9  # PIPELINE_CRASH_AT: after step 3 was logged, before its checkpoint completed
    assert code == 0, err[-3000:]
    assert f"resuming {run} from global_step2, its last complete checkpoint" in out
    assert "settings changed since " + str(run / "args.json") + ": --train-steps 3 -> 5" in out
    logged = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]  # step 3 of the killed run dropped, logged again
    assert [r["step"] for r in records(run) if "valid_loss" in r] == [2, 4, 5]
    # the run's schedule (linear to step 3) continues from its step 2, its decay stretched to step 5: no jump (a new
    # schedule for --train-steps 5 would repeat step 2's 5.5e-3 at step 3; measured here: 5.5e-3, then 4e-3)
    first = LRSchedule(LR["lr"], LR["warmup"], 3, "linear", LR["min_lr"])
    assert logged[1]["lr"] == pytest.approx(first(2), rel=1e-6)
    assert [r["lr"] for r in logged[2:]] == pytest.approx([first.continued(2, 5)(s) for s in (3, 4, 5)], rel=1e-6)
    assert logged[1]["lr"] > logged[2]["lr"] > logged[3]["lr"] > logged[4]["lr"] == pytest.approx(LR["min_lr"])
    assert "LR schedule: the run's (peak 0.01, warmup 1, linear to 0.001 at step 3) continues from step 2" in out
    summary = re.escape(f"done: steps 3-5, train loss {logged[-1]['loss']:.4f}, validation loss "
                        f"{records(run)[-1]['valid_loss']:.4f}, ") + r"[\d,]+ tokens/s, " + re.escape(
                            f"last checkpoint {run}/global_step5")
    assert len(re.findall("^" + summary + "$", out, flags=re.M)) == 1, out[-2000:]
    assert f"python -m pipeline.export_hf --checkpoint {run} --out {run}-hf" in out
    valid = {r["step"]: r["valid_loss"] for r in records(run) if "valid_loss" in r}
    assert f"step 4: validation loss {valid[4]:.4f}" in out


def test_settings_saved_in_the_run_flags_over_the_config_file(runs):
    d, _ = runs
    args = json.loads((d / "run" / "args.json").read_text())
    assert args["train_steps"] == 5  # the flag over the file's 4
    assert (args["seq_length"], args["tokenizer"], args["lr_decay_style"]) == (32, "bytes", "linear")  # the file's
    assert args["config_file"] == str(d / "job.yaml")
    saved = json.loads((d / "run" / "ds_config.json").read_text())
    assert (saved["train_batch_size"], saved["train_micro_batch_size_per_gpu"]) == (4, 4)


def test_no_resume_and_unknown_config_keys_are_refused_in_one_line(runs):
    d, results = runs
    code, _, err = results[2]
    assert code == 2 and len(error_lines(err)) == 1, err[-2000:]
    assert error_lines(err)[0].startswith(f"error: --save {d / 'run'} holds args.json, config.json")
    assert "--no-resume starts a new run in a new or empty directory only" in err
    for (code, _, err), prog in zip(results[3:5], ("mds-pretrain", "mds-export-hf")):
        assert code == 2 and len(error_lines(err)) == 1, err[-2000:]
        assert error_lines(err)[0].startswith(f"error: {d / 'typo.toml'}: key 'train_stepz' is not a flag of ")
        assert prog in error_lines(err)[0]
    assert "did you mean 'train_steps'?" in results[3][2]


def test_auto_deepspeed_config_is_filled_from_the_flags_or_refused(runs):
    d, results = runs
    code, out, err = results[5]
    assert code == 0, err[-3000:]
    filled = json.loads((d / "fresh" / "ds_config.json").read_text())
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["train_batch_size"]) == (1, 2, 2)
    assert filled["optimizer"]["params"]["lr"] == 2e-3 and filled["optimizer"]["params"]["weight_decay"] == 0.0
    assert (filled["gradient_clipping"], filled["bf16"]["enabled"]) == (1.0, False)  # no GPU here: fp32
    assert records(d / "fresh")[0]["lr"] == pytest.approx(2e-3)  # warmup 1: the peak at step 1
    code, out, err = results[6]  # no --lr, no --save
    assert out.startswith("warning: no --save: this run keeps nothing"), out[:500]
    assert error_lines(err) == [f'error: {d / "auto.json"}: optimizer.params.lr is "auto" and cannot be filled '
                                f"here; pass --lr or give a number"]
    code, _, err = results[7]  # no batch size anywhere
    assert code == 2 and len(error_lines(err)) == 1
    assert "set train_micro_batch_size_per_gpu (or --micro-batch-size)" in error_lines(err)[0]


def test_a_resumed_schedule_continues_or_is_overridden():
    """``Scheduler.load_state_dict``: the saved schedule continues (same LR at the saved step, decay to the new end),
    or with ``override`` this command's applies at the saved step."""
    saved = LRSchedule(1e-2, 2, 10, "cosine", 1e-3)
    state = {"last_step": 6, "schedule": {k: v for k, v in vars(saved).items() if k != "override"}}
    for override, expected in ((False, saved(6)), (True, LRSchedule(5e-3, 2, 20, "cosine", 1e-3)(6))):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = Scheduler(opt, LRSchedule(5e-3, 2, 20, "cosine", 1e-3, override=override))
        sched.load_state_dict(state)
        assert sched.get_lr()[0] == pytest.approx(expected, rel=1e-9)
        lrs = [sched.schedule(s) for s in range(6, 21)]
        if not override:
            assert lrs == sorted(lrs, reverse=True) and lrs[-1] == pytest.approx(1e-3)


def test_config_file_values_become_the_flags_they_name(tmp_path):
    """Switches (store_true and --x/--no-x), lists of a repeatable flag (replaced whole by the command line's),
    values typed by the flag; a switch given a word and a file that is no mapping are refused naming the file."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"sequence-parallel": True, "exit_signal_handler": False, "data": ["a", "b"],
                                   "train_steps": "7", "lr": 3e-4}))
    args = parse_args(["--config", str(job)])
    assert (args.sequence_parallel, args.exit_signal_handler, args.data, args.train_steps, args.lr) == \
        (True, False, ["a", "b"], 7, 3e-4)
    args = parse_args(["--config", str(job), "--data", "c", "--exit-signal-handler"])
    assert (args.data, args.exit_signal_handler) == (["c"], True)
    job.write_text("sequence_parallel: maybe\n")
    with pytest.raises(ConfigFileError, match=f"{job}: key 'sequence_parallel' is a switch"):
        parse_args(["--config", str(job)])
    job.write_text("- train_steps\n")
    with pytest.raises(ConfigFileError, match=f"{job}: holds a list, not a mapping"):
        parse_args(["--config", str(job)])
