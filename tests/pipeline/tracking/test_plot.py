"""pipeline.plot: the curves of several runs' metrics.jsonl overlaid, one panel per quantity, against step."""
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT
from pipeline.tracking.plot import curves_figure, read_series


def write_run(d, steps, valid_every, scale, mfu=True):
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"settings": {"lr": 1e-3}}) + "\n")  # a record without a step is not a point
        for s in steps:
            f.write(json.dumps({"step": s, "loss": scale * math.exp(-s / 10), "lr": 1e-3 * min(1, s / 3),
                                "tokens_per_s": 1000.0 + s, "mfu": 0.01 * s if mfu else None, "time": 1.0}) + "\n")
            if s % valid_every == 0:
                f.write(json.dumps({"step": s, "valid_loss": scale * math.exp(-s / 12)}) + "\n")
    return d


def lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_runs_are_overlaid_panel_by_panel(tmp_path):
    a = write_run(tmp_path / "tp2", range(1, 13), 4, 3.0)
    b = write_run(tmp_path / "pp2", range(1, 9), 4, 2.0, mfu=False)
    series = [read_series(a), read_series(b)]
    assert [s for s, _ in series[0]["valid_loss"]] == [4, 8, 12] and "mfu" not in series[1]
    fig = curves_figure(series, ["tp2", "pp2"])
    loss, lr, tput, mfu = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate", "tokens/s", "MFU"]
    got = lines(loss)
    assert set(got) == {"tp2 (train)", "tp2 (valid)", "pp2 (train)", "pp2 (valid)"}
    assert got["pp2 (valid)"] == ([4, 8], [pytest.approx(2.0 * math.exp(-s / 12)) for s in (4, 8)])
    assert got["tp2 (train)"][0] == list(range(1, 13))
    assert loss.get_xlabel() == "step"
    assert lines(lr)["tp2"][1][:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert set(lines(tput)) == {"tp2", "pp2"} and set(lines(mfu)) == {"tp2"}


def test_moe_loads_dropped_fraction_and_aux_loss_get_panels_one_line_per_layer(tmp_path):
    d = tmp_path / "moe"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, 5):
            f.write(json.dumps({"step": s, "loss": 1.0 / s, "moe_tokens_per_expert_1": [3, 5], "moe_aux_loss": 0.2 / s,
                                **{f"moe_load_ratio_{i}": 1.0 + i + 0.1 * s for i in (1, 3, 10)},
                                **{f"moe_dropped_fraction_{i}": 0.01 * s for i in (1, 3, 10)}}) + "\n")
    fig = curves_figure([read_series(d)], ["moe"])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "MoE load max/mean", "MoE dropped fraction", "MoE aux loss"]
    load = lines(fig.axes[1])
    assert list(load) == ["moe, layer 1", "moe, layer 3", "moe, layer 10"]  # layer order, not string order
    assert load["moe, layer 10"][1] == pytest.approx([11.1, 11.2, 11.3, 11.4])
    assert lines(fig.axes[3])["moe"][1] == pytest.approx([0.2, 0.1, 0.2 / 3, 0.05])


def test_a_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    d = write_run(tmp_path / "run", range(1, 6), 100, 1.0)
    with open(d / "metrics.jsonl", "a") as f:  # resumed from step 3
        for s in (4, 5, 6):
            f.write(json.dumps({"step": s, "loss": 0.5, "lr": 1e-3}) + "\n")
    assert read_series(d)["loss"][-3:] == [(4, 0.5), (5, 0.5), (6, 0.5)]


def test_command_writes_a_png_and_refuses_what_is_not_a_run(tmp_path):
    a, b = write_run(tmp_path / "a", range(1, 6), 2, 1.0), write_run(tmp_path / "b", range(1, 6), 2, 2.0)
    out = tmp_path / "curves.png"
    cmd = [sys.executable, "-m", "pipeline.plot", str(a), str(b / "metrics.jsonl"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)  # issue 12: no overwrite
    assert proc.returncode == 2 and f"--out {out} exists; pass --force" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pipeline.plot", str(b / "metrics.jsonl"), "--out",
                           str(b / "metrics.jsonl"), "--force"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is the input RUN" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pipeline.plot", str(tmp_path / "none"), "--out", str(out),
                           "--force"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
