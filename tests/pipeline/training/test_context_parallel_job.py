"""Context parallelism (``--context-parallel``, DeepSpeed-Ulysses) through the main job: 5 steps (2 micro-batches a
step), dropout 0, per-step losses equal one process at CP2, (TP2, CP2), (TP2, --sequence-parallel, CP2) and (CP2, DP2,
ZeRO-2), and CP2 with ALST's tiling (--tiled-mlp, --tiled-loss); a run saved at CP2 resumes at CP1 with its optimizer state; the refusals, one line each, before any work."""
import json
import os

import pytest
import torch.distributed as dist
from dist import run_distributed
from test_checkpoint import args
from test_sequence_parallel_job import STEPS, _job, _max_rel, _refusal_worker, _refused, setup, single

from pipeline.engine.distributed import free_port, init_distributed

__all__ = ["setup", "single"]  # the fixtures of the sequence-parallel job tests: same data, configs, reference


@pytest.mark.parametrize("layout,world,extra,ds", [
    ("CP2", 2, ("--save-interval", "2"), "ds.json"),
    ("TP2 CP2", 4, ("--tensor-parallel", "2"), "ds.json"),
    ("TP2 SP CP2", 4, ("--tensor-parallel", "2", "--sequence-parallel"), "ds.json"),
    ("CP2 DP2 ZeRO-2", 4, (), "ds_z2.json"),
    ("CP2 tiled MLP and loss", 2, ("--tiled-mlp", "2", "--tiled-loss", "4"), "ds.json"),
])
def test_main_job_context_parallel_equals_single_process(setup, single, layout, world, extra, ds):
    got = _job(setup, setup / layout.replace(" ", "_"), world, "--context-parallel", "2", *extra, ds=ds)
    rel = _max_rel(got, single)
    print(f"{layout}: max relative loss difference over {STEPS} steps {rel:.2e}")
    assert rel < 1e-5, (layout, got, single)


def test_context_parallel_checkpoint_resumes_at_cp1(setup, single, tmp_path):
    """Saved at CP2 (ZeRO-1: the optimizer partitioned over data x context = 2 ranks), resumed at CP1: steps 3-5
    follow the uninterrupted run; the checkpoint's model config does not name CP."""
    src = setup / "CP2"
    if not (src / "global_step2").is_dir():
        _job(setup, src, 2, "--context-parallel", "2", "--save-interval", "2")
    assert "context_parallel" not in json.loads((src / "config.json").read_text())
    got = _job(setup, tmp_path / "cp1", 1, "--load", str(src), "--load-tag", "global_step2")
    rel = max(abs(got[s] - single[s]) / single[s] for s in (3, 4, 5))
    print(f"CP2 step 2 -> CP1: steps 3-5 max relative loss difference {rel:.2e}")
    assert sorted(got) == [3, 4, 5] and rel < 1e-5, (got, single)


def _refused_on_every_rank(rank, argv, port):
    """The command's one line and exit status; the command leaves the process group on a user error (as under
    torchrun), so the ranks join a fresh one on ``port`` for the launcher's closing barrier."""
    out = _refusal_worker(rank, argv)
    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = str(port)
        init_distributed("gloo")
    return out


def test_refusals_before_any_work(setup, tmp_path):
    err = _refused(tmp_path, setup, "--context-parallel", "2", "--pipeline-parallel", "2")
    assert err.strip().splitlines()[-1].startswith("error: --context-parallel 2 with --pipeline-parallel 2: "
                                                   "DeepSpeed's pipeline engine has no context-parallel group"), err
    assert err.count("error: ") == 1 and "Traceback" not in err
    cases = [(("--seq-length", "31"), "seq_length 31 is not divisible by context_parallel 2"),
             (("--tensor-parallel", "2", "--sequence-parallel", "--seq-length", "30"),
              "seq_length 30 is not divisible by context_parallel x tensor_parallel = 4 (sequence parallelism)")]
    for extra, message in cases:
        world = 4 if "--tensor-parallel" in extra else 2
        argv = args(setup, tmp_path / "run", 1, "--context-parallel", "2", *extra, model="nodrop.json")
        (code0, err0), *others = run_distributed(_refused_on_every_rank, world, argv, free_port())
        assert code0 == 2 and message in err0 and err0.count("error: ") == 1, err0
        assert all(code == 2 and "error: " not in err for code, err in others)  # rank 0 only
        # before any work: at most the run's lock (taken in setup), no config, metrics or checkpoint
        assert not (tmp_path / "run").exists() or not [p for p in (tmp_path / "run").iterdir()
                                                       if p.name != ".run.lock"]
