"""``python -m pipeline.plan`` as a user runs it: the validation table against the papers, the ranked layouts
of a model, and its refusals as one line each."""
import json
import sys

from cli import run_cli
from conftest import ROOT

PLAN = [sys.executable, "-m", "pipeline.plan"]


def _table_rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("published result", "---"):
            rows[cells[0]] = cells
    return rows


def test_validate_reproduces_both_papers_within_tolerance_and_draws_it(tmp_path):
    plot = tmp_path / "validation.png"
    proc = run_cli(PLAN + ["--validate", "--plot", plot], ROOT, check=False)
    rows = _table_rows(proc.stdout)
    assert len(rows) == 5, proc.stdout
    megatron = [r for name, r in rows.items() if name.startswith("Megatron")]
    mlstm = [r for name, r in rows.items() if name.startswith("mLSTM")]
    assert len(megatron) == 2 and len(mlstm) == 3, proc.stdout
    for r in megatron:  # within 5 points of efficiency
        assert abs(float(r[2].rstrip("%")) - float(r[1].rstrip("%"))) <= 5.0, proc.stdout
    for r in mlstm:  # within 15% of the published speed-up
        published, predicted = float(r[1].rstrip("x")), float(r[2].rstrip("x"))
        assert abs(predicted - published) <= 0.15 * published, proc.stdout
    assert all(r[5] == "yes" for r in rows.values()) and proc.returncode == 0, proc.stdout + proc.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_ranks_feasible_layouts_and_writes_them(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli(PLAN + ["--model-config", "gpt2-1.3b", "--gpus", "16", "--hardware", "a100-dgx",
                           "--global-batch-size", "64", "--top", "5", "--json", out], ROOT)
    assert "| 1 | TP" in proc.stdout
    plans = json.loads(out.read_text())
    assert len(plans) == 5
    steps = [p["step_s"] for p in plans]
    assert steps == sorted(steps)
    for p in plans:
        lay = p["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == 16 and 64 % (lay["dp"] * lay["micro_batch"]) == 0
        assert sum(p["memory_bytes"].values()) <= 0.9 * 80 * 2**30
        assert 0 < p["mfu"] < 1


def _refusal(args):
    proc = run_cli(PLAN + args, ROOT, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_refusals_are_one_line():
    assert "--tp 3: does not divide --gpus 8" in _refusal(["--model-config", "llama-8b", "--gpus", "8", "--tp", "3"])
    assert "no layout fits" in _refusal(["--model-config", "llama-70b", "--gpus", "2", "--hardware", "v100-dgx2h",
                                         "--global-batch-size", "8"])
    assert "--hardware" in _refusal(["--model-config", "llama-8b", "--gpus", "8", "--hardware", "tpu"])
    assert "add --validate" in _refusal(["--plot", "x.png"])
    assert "num_heads" in _refusal(["--model-config", "gpt2-1.3b", "--gpus", "12", "--tp", "3"])
