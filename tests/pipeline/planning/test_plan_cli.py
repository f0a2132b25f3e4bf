"""``python -m pipeline.plan`` as a user runs it: the validation table against the papers, the ranked layouts
of a model, and its refusals as one line each."""
import json
import shlex
import sys

from cli import run_cli
from conftest import ROOT
from forked_cli import run_forked

from pipeline.pretrain import parse_args as pretrain_parse_args

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


def _plan_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and line[2].isdigit()]


def test_the_plan_explains_its_choice_folds_identical_rows_and_gives_the_command(tmp_path):
    """One process, four plans: memory binds a 70B model on 16 H100s, compute an 8B one on 64 H200s (its ZeRO-1
    and ZeRO-2 rows print the same numbers: folded), the bubble a pinned 2-stage pipeline; the help of the pins."""
    cases = [("pipeline.plan", ["--model-config", "llama-70b", "--gpus", "16", "--global-batch-size", "64",
                                "--top", "3"]),
             ("pipeline.plan", ["--model-config", "llama-8b", "--gpus", "64", "--hardware", "h200-dgx",
                                "--seq-length", "4096", "--global-batch-size", "1024", "--top", "6"]),
             ("pipeline.plan", ["--model-config", "gpt2-1.3b", "--gpus", "16", "--hardware", "a100-dgx",
                                "--global-batch-size", "64", "--pp", "2", "--top", "2"]),
             ("pipeline.plan", ["--help"])]
    (code70, out70, _), (code8, out8, _), (code_pp, out_pp, _), (_, help_text, _) = run_forked(cases, ROOT)
    assert code70 == code8 == code_pp == 0
    assert "# rank 1 is bound by memory" in out70 and "faster layouts do not fit" in out70, out70
    assert "# rank 1 is bound by compute" in out8 and "no faster layout was left out" in out8, out8
    assert "# rank 1 is bound by the pipeline bubble" in out_pp, out_pp
    first = _plan_rows(out70)[0]
    used, free = float(first[2].split()[0]), float(first[3])
    assert abs(used + free - 0.9 * 80) <= 0.11 and f"{free:.1f} GiB free" in out70  # 10% of HBM reserved
    rows8 = _plan_rows(out8)
    assert len(rows8) == 6 and any("(same: ZeRO-2)" in r[1] for r in rows8), out8
    shown = [tuple(r[2:]) for r in rows8]
    assert all(a != b for a, b in zip(shown, shown[1:])), out8  # no two neighbours print the same numbers
    for out in (out70, out8, out_pp):
        command = next(line for line in out.splitlines() if line.startswith("deepspeed "))
        argv = shlex.split(command.split(" pipeline/pretrain.py ")[1].split("  #")[0])
        args = pretrain_parse_args(argv)
        label = _plan_rows(out)[0][1]
        assert f"TP{args.tensor_parallel} PP{args.pipeline_parallel} " in label and f"mb={args.micro_batch_size}" in label
        assert (ROOT / args.deepspeed_config).is_file() and args.sequence_parallel == (" SP " in label)
    assert "pipeline_bf16_zero1.json" in out_pp and '"stage": 0' in out_pp.split("deepspeed ")[-1]
    for flag in ("--tp", "--pp", "--zero", "--micro-batch"):
        described = help_text.split(f"  {flag} ")[1].split("\n  --")[0]
        assert len(described.split()) > 3, (flag, described)
