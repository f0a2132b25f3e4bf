"""The slow rank named: a real 2-rank gloo job (the project's train_loop, a real model, its gradients all-reduced
every step) run twice in one launch, once as is and once with rank 1 delayed by PIPELINE_DELAY_RANK; the
detector's records and its one warning line name rank 1 only when it is delayed."""
import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import run_distributed

from pipeline.job.errors import InputError
from pipeline.job.loop import train_loop
from pipeline.tracking.metrics import MetricsWriter
from pipeline.tracking.straggler import DELAY_ENV, debug_delay, straggler_hook

STEPS, INTERVAL, DELAY, THRESHOLD = 6, 3, 0.25, 2.0


def _job(out_dir: str, delay: str | None) -> str:
    """Six steps of a small MLP, gradients all-reduced; returns this rank's stderr."""
    if delay:
        os.environ[DELAY_ENV] = delay
    else:
        os.environ.pop(DELAY_ENV, None)
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.ReLU(), torch.nn.Linear(384, 384))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = model(torch.randn(128, 384)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        return loss.item()

    name = f"{out_dir}/metrics-{'delayed' if delay else 'plain'}.jsonl"
    metrics = MetricsWriter(Path(name) if dist.get_rank() == 0 else None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train_loop(step, first=1, last=STEPS, desc="straggler", hooks=[straggler_hook(INTERVAL, metrics, threshold=THRESHOLD)])
    metrics.close()
    return err.getvalue()


def _both(rank, out_dir):
    return _job(out_dir, None), _job(out_dir, f"1:{DELAY}")


def test_the_delayed_rank_is_named(tmp_path):
    (plain0, delayed0), (plain1, delayed1) = run_distributed(_both, 2, str(tmp_path))
    delayed = [json.loads(line) for line in (tmp_path / "metrics-delayed.jsonl").read_text().splitlines()]
    plain = [json.loads(line) for line in (tmp_path / "metrics-plain.jsonl").read_text().splitlines()]
    print("delayed run, rank 0's stderr:", [x for x in delayed0.splitlines() if "warning" in x])
    print("records:", delayed, plain, sep="\n")
    assert [r["step"] for r in delayed] == [3, 6] == [r["step"] for r in plain]
    for r in delayed:  # rank 1 spun 3 x 0.25 s more per interval, against ~13 ms of compute: measured 61.9, 58.9
        assert r["straggler_rank"] == 1 and r["straggler_ratio"] > 10, r
        assert r["straggler_seconds"] - r["fastest_rank_seconds"] > 0.5 * INTERVAL * DELAY, r
    warnings = [x for x in delayed0.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2 and all("rank 1 is the slowest" in w for w in warnings), delayed0
    assert not [x for x in plain0.splitlines() if x.startswith("warning:")], plain0
    assert all(r["straggler_ratio"] < THRESHOLD for r in plain), plain  # measured: 1.04, 1.05
    assert "warning" not in delayed1 + plain1  # one line, from rank 0


def test_delay_setting_is_checked(monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "1:0.5")
    assert debug_delay(1) == 0.5 and debug_delay(0) == 0.0
    for bad in ("one:0.5", "1:nan", "1:-1", "1"):
        monkeypatch.setenv(DELAY_ENV, bad)
        with pytest.raises(InputError, match=DELAY_ENV):
            debug_delay(0)
