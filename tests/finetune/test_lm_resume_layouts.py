"""SFT and DPO stopped at one layout and continued at another equal the run done in one go at one process, step
for step and in their final weights; a finished run answers the same command with its summary, as finetune.train
does. One 2-rank launch holds the stopped halves (and one continuation), one Python start the rest (forked):

* full SFT at DP2 with ZeRO-2, stopped after step 2, refused while --data's contents differ, continued at TP2
  with ZeRO-1;
* full SFT at CP2 (packed conversations split over the context ranks), stopped after step 2, continued at TP2 with
  sequence parallelism;
* full SFT on two pipeline stages (the document ids travel with the activations), stopped after step 2, continued
  on them (its exports gathered from both stages), and stopped there again, continued at TP2;
* LoRA SFT on two pipeline stages (each stage's own adapters), stopped after step 2, continued on them, and
  stopped there again, continued at one process;
* LoRA DPO at TP2 with ZeRO-1, continued at TP1 with ZeRO-2: the reference (the base, the adapters off) the same, its rewards logged equal;
* full DPO at DP2 with --precompute-ref-log-probs, continued at TP1 from the stored SAVE/reference_logps.jsonl
  (reused, not recomputed: the file untouched), and refused while --data differs from the pairs it holds;
* the finished SFT and DPO runs' own commands again: their summary and the next commands, exit 0; another --lr
  refused naming it.
"""
import contextlib
import importlib
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from dist import run_distributed
from forked_cli import run_forked
from test_post_training_cli import DPO_KEYS, DS, LORA, _args, _steps, work  # noqa: F401  (work: the fixture)

from pipeline.checkpoints.model_dir import read_model_dir

BETA = ["--beta", "0.1"]
SFT, DPO = "finetune.lm.job.sft", "finetune.lm.job.dpo"
STOP = {"PIPELINE_SIGNAL_AT": "2"}  # SIGTERM after step 2: the state saved, the command returns


def _commands(rank, cases):
    """Each case in turn on every rank: a command (its exit code and the end of its stderr), or a file written by
    rank 0."""
    results = []
    for case in cases:
        if case[0] == "write":
            if rank == 0:
                Path(case[1]).write_text(case[2])
            dist.barrier()
            continue
        module, argv, env = case
        os.environ.pop("PIPELINE_SIGNAL_AT", None)
        os.environ.update(env)
        err, code = io.StringIO(), 0
        try:
            with contextlib.redirect_stderr(err):
                importlib.import_module(module).main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        results.append((code, err.getvalue()[-3000:]))
    return results


@pytest.fixture(scope="module")
def runs(work, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("lm_resume")
    (d / "zero2.json").write_text(json.dumps({**DS, "zero_optimization": {"stage": 2}}))
    pairs = (work / "pairs.jsonl").read_text()
    (d / "pre_pairs.jsonl").write_text(pairs)
    changed = pairs.replace("Paris.", "Paris!", 1)
    sft = _args(work, "chats.jsonl", d / "sft", "--seq-length", 64)
    sft_ref = _args(work, "chats.jsonl", d / "sft_ref", "--seq-length", 64)
    sft_cp = _args(work, "chats.jsonl", d / "sft_cp", "--seq-length", 64)
    sft_pp, sft_pp_tp = (_args(work, "chats.jsonl", d / name, "--seq-length", 64) for name in ("sft_pp", "sft_pp_tp"))
    lora_pp, lora_pp_tp1, lora_sft_ref = (_args(work, "chats.jsonl", d / name, "--seq-length", 64, *LORA)
                                          for name in ("lora_pp", "lora_pp_tp1", "lora_sft_ref"))
    lora, lora_ref = (_args(work, "pairs.jsonl", d / name, *BETA, *LORA) for name in ("lora", "lora_ref"))
    pre, pre_ref = (_args(work, d / "pre_pairs.jsonl", d / name, *BETA, "--precompute-ref-log-probs")
                    for name in ("pre", "pre_ref"))
    chats = (work / "chats.jsonl").read_text()
    codes = run_distributed(_commands, 2, [
        (SFT, [*sft, "--deepspeed_config", d / "zero2.json"], STOP),  # DP2, ZeRO-2
        ("write", work / "chats.jsonl", chats.replace("Rome.", "Rome!", 1)),
        (SFT, [*sft, "--tensor-parallel", 2], {}),  # refused: --data's contents changed since the stop
        ("write", work / "chats.jsonl", chats),
        (SFT, [*sft, "--tensor-parallel", 2], {}),  # continued at TP2, ZeRO-1 (ds.json)
        (DPO, [*lora, "--tensor-parallel", 2], STOP),
        (DPO, pre, STOP),  # DP2
        ("write", d / "pre_pairs.jsonl", changed),
        (DPO, pre, {}),  # refused: not the pairs of the stored reference log-probabilities
        ("write", d / "pre_pairs.jsonl", pairs),
        (SFT, [*sft_cp, "--context-parallel", 2], STOP),
        (SFT, [*sft_cp, "--tensor-parallel", 2, "--sequence-parallel"], {}),
        (SFT, [*sft_pp, "--pipeline-parallel", 2], STOP),
        (SFT, [*sft_pp, "--pipeline-parallel", 2], {}),
        (SFT, [*sft_pp_tp, "--pipeline-parallel", 2], STOP),
        (SFT, [*sft_pp_tp, "--tensor-parallel", 2], {}),
        (SFT, [*lora_pp, "--pipeline-parallel", 2], STOP),
        (SFT, [*lora_pp, "--pipeline-parallel", 2], {}),
        (SFT, [*lora_pp_tp1, "--pipeline-parallel", 2], STOP),
    ])
    stored = d / "pre" / "reference_logps.jsonl"
    before = (stored.stat().st_ino, stored.stat().st_mtime_ns, stored.read_bytes())
    forked = run_forked([(SFT, sft_ref), (DPO, lora_ref), (DPO, [*lora, "--deepspeed_config", d / "zero2.json"]),
                         (DPO, pre_ref), (DPO, pre),
                         (SFT, sft_ref), (SFT, [*sft_ref, "--lr", "0.02"]), (DPO, pre),
                         (SFT, lora_sft_ref), (SFT, lora_pp_tp1)], d)
    return d, codes, before, forked


def _weights_diff(a: Path, b: Path) -> float:
    """The largest difference of the exported weights (model/), relative to each tensor's largest value."""
    (_, x, _), (_, y, _) = read_model_dir(a / "model"), read_model_dir(b / "model")
    assert x.keys() == y.keys()
    return max(((x[k] - y[k]).abs().max() / y[k].abs().max().clamp(min=1e-12)).item() for k in x)


def _metrics_diff(ours, theirs, keys=("loss",)):
    """The largest difference of the logged metrics, step by step (relative above 1)."""
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(ours, theirs) for k in keys)


def _ok(result):
    code, out, err = result if len(result) == 3 else (result[0], "", result[1])
    assert code == 0, err[-3000:]
    return out, err


def test_full_sft_stopped_at_dp2_zero2_continued_at_tp2_equals_one_process(runs):
    d, ranks, _, forked = runs
    for rank in ranks:
        _ok(rank[0])
        assert rank[1][0] == 2, rank[1][1]
        _ok(rank[2])
    refusal = [line for line in ranks[0][1][1].splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and refusal[0].startswith(f"error: --save {d / 'sft'} holds an interrupted run with "
                                                       f"other settings (data_contents: 'sha256:"), refusal
    assert "(saved at TP 1, PP 1, DP 2, EP 1, ZeRO 2) at TP 2, PP 1, DP 1, EP 1, ZeRO 1: through a universal " \
           "checkpoint" in ranks[0][2][1]
    _ok(forked[0])
    losses, weights = _metrics_diff(_steps(d / "sft"), _steps(d / "sft_ref")), _weights_diff(d / "sft", d / "sft_ref")
    print(f"full SFT DP2 ZeRO-2 stopped after step 2, continued at TP2 ZeRO-1 vs one process: losses {losses:.1e}, "
          f"weights {weights:.1e}")
    assert losses < 1e-6 and weights < 2e-5  # measured 0.0 and 1.6e-6 (fp32: TP2's gradients round apart from TP1's
    # by ~1e-6, test_post_training_tp; too little to move a logged loss)


def test_full_sft_stopped_at_cp2_continued_at_tp2_with_sp_equals_one_process(runs):
    d, ranks, _, forked = runs
    for rank in ranks:
        _ok(rank[6])
        _ok(rank[7])
    assert "through a universal checkpoint" in ranks[0][7][1], ranks[0][7][1]
    _ok(forked[0])
    losses, weights = (_metrics_diff(_steps(d / "sft_cp"), _steps(d / "sft_ref")),
                       _weights_diff(d / "sft_cp", d / "sft_ref"))
    print(f"full SFT CP2 stopped after step 2, continued at TP2 + SP vs one process: losses {losses:.1e}, "
          f"weights {weights:.1e}")
    assert losses < 1e-6 and weights < 5e-5  # measured 0.0 and 1.1e-5 (fp32: Adam divides each entry by its own
    # magnitude, so a near-zero gradient entry's rounding at CP2 or TP2 moves its weight the most)


def test_full_sft_on_pipeline_stages_stopped_and_continued_equals_one_process(runs):
    """On the stages and from them at TP2: the losses and the exported weights (gathered from both stages: the
    tied embedding's first-stage copy) of the run done in one go at one process."""
    d, ranks, _, forked = runs
    for rank in ranks:
        for i in (8, 9, 10, 11):
            _ok(rank[i])
    assert "(saved at TP 1, PP 2, DP 1, EP 1, ZeRO 1) at TP 2, PP 1, DP 1, EP 1, ZeRO 1: through a universal " \
           "checkpoint" in ranks[0][11][1], ranks[0][11][1]
    _ok(forked[0])
    for name in ("sft_pp", "sft_pp_tp"):
        losses, weights = _metrics_diff(_steps(d / name), _steps(d / "sft_ref")), _weights_diff(d / name, d / "sft_ref")
        print(f"full SFT PP2 stopped after step 2, continued at {'PP2' if name == 'sft_pp' else 'TP2'} vs one "
              f"process: losses {losses:.1e}, weights {weights:.1e}")
        assert losses < 1e-6 and weights < 2e-5  # measured 4.8e-8 / 0.0 (continued at PP2), 4.5e-8 / 1.1e-6 (TP2)


def test_lora_sft_on_pipeline_stages_stopped_and_continued_equals_one_process(runs):
    """Each stage trains the adapters of its own layers (drawn as one process draws them): stopped after step 2
    and continued on the stages, or at one process through a universal checkpoint of the adapters, the losses and
    the merged export are the one-process run's, and the PEFT adapter is written."""
    d, ranks, _, forked = runs
    for rank in ranks:
        for i in (12, 13, 14):
            _ok(rank[i])
    _ok(forked[8])
    assert "(saved at TP 1, PP 2, DP 1, EP 1, ZeRO 1) at TP 1, PP 1, DP 1, EP 1, ZeRO 1: through a universal " \
           "checkpoint" in _ok(forked[9])[1]
    for name in ("lora_pp", "lora_pp_tp1"):
        losses = _metrics_diff(_steps(d / name), _steps(d / "lora_sft_ref"))
        weights = _weights_diff(d / name, d / "lora_sft_ref")
        print(f"LoRA SFT PP2 stopped after step 2, continued at {'PP2' if name == 'lora_pp' else 'TP1'} vs one "
              f"process: losses {losses:.1e}, merged weights {weights:.1e}")
        assert losses < 1e-6 and weights < 2e-5
        assert (d / name / "adapter" / "adapter_config.json").is_file()


def test_lora_dpo_stopped_at_tp2_zero1_continued_at_tp1_zero2_equals_one_process(runs):
    """The reference of both is the base with the adapters off: the rewards of steps 3-4 (beta x the policy's
    log-ratio to it) equal the one-process run's."""
    d, ranks, _, forked = runs
    _ok(ranks[0][3])
    _ok(forked[1])
    assert "(saved at TP 2, PP 1, DP 1, EP 1, ZeRO 1) at TP 1, PP 1, DP 1, EP 1, ZeRO 2: through a universal " \
           "checkpoint" in _ok(forked[2])[1]
    metrics = _metrics_diff(_steps(d / "lora"), _steps(d / "lora_ref"), DPO_KEYS)
    weights = _weights_diff(d / "lora", d / "lora_ref")
    print(f"LoRA DPO TP2 ZeRO-1 stopped after step 2, continued at TP1 ZeRO-2 vs one process: loss and rewards {metrics:.1e}, "
          f"merged weights {weights:.1e}")
    assert metrics < 1e-6 and weights < 2e-5  # measured 0.0 and 2.1e-6 (fp32: steps 1-2 at TP2, as above)
    assert (d / "lora" / "adapter" / "adapter_config.json").is_file()


def test_full_dpo_precomputed_at_dp2_continued_at_tp1_reuses_the_stored_log_probs(runs):
    """The stored log-probabilities are used again (the file is not written again: the same inode, time and
    bytes), and --data changed since is refused before any work."""
    d, ranks, before, forked = runs
    stored = d / "pre" / "reference_logps.jsonl"
    for rank in ranks:
        _ok(rank[4])
        code, err = rank[5]
        assert code == 2, err
    assert [line for line in ranks[0][5][1].splitlines() if line.startswith("error:")] == [
        f"error: --data {d / 'pre_pairs.jsonl'}: not the pairs the interrupted run in {d / 'pre'} started with "
        f"(line 1 differs from {stored}); continue it with its own data, or pass --force to start afresh"]
    _ok(forked[3])
    _, err = _ok(forked[4])
    assert f"note: the reference's log-probabilities of {stored} (computed before the interruption) are used " \
           f"again: no reference pass" in err, err[-2000:]
    assert (stored.stat().st_ino, stored.stat().st_mtime_ns, stored.read_bytes()) == before
    metrics = _metrics_diff(_steps(d / "pre"), _steps(d / "pre_ref"), DPO_KEYS)
    weights = _weights_diff(d / "pre", d / "pre_ref")
    print(f"full DPO DP2, reference precomputed, stopped after step 2, continued at TP1 vs one process: loss and "
          f"rewards {metrics:.1e}, weights {weights:.1e}")
    assert metrics < 1e-6 and weights < 1e-6  # measured 0.0 and 0.0 (fp32: DP2 and TP1 sum alike)


def test_a_finished_run_answers_its_command_with_its_summary(runs):
    """As finetune.train: the same command again says the run is finished, its summary and the next commands,
    exit 0, nothing appended; another setting is refused naming it."""
    d, _, _, forked = runs
    for (code, out, err), save in ((forked[5], d / "sft_ref"), (forked[7], d / "pre")):
        assert code == 0, err[-3000:]
        assert f"{save} holds the run this command finished at step 4: nothing to run (--force trains it again)" \
            in out, out[-2000:]
        summary = re.escape(f"done: no steps to run (at step 4), train loss {_steps(save)[-1]['loss']:.4f}, exports "
                            f"in {save} (hf/, model/)")
        assert re.search(f"^{summary}$", out, flags=re.M), out[-2000:]
        assert f"  python -m pipeline.generate --hf {save / 'hf'} --prompt 'Hello'" in out
        assert [r["step"] for r in _steps(save)] == [1, 2, 3, 4]
    code, _, err = forked[6]
    assert code == 2 and [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --save {d / 'sft_ref'}: holds a finished run with other settings (--lr 0.01 -> 0.02); choose a new "
        f"directory, or pass --force to train it again"], err[-2000:]
