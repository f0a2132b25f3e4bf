"""Context parallelism (``--context-parallel``, DeepSpeed-Ulysses) through the main job: 5 steps (2 micro-batches a
step), fp32, dropout 0, per-step losses equal one process at (CP2, DP2), (TP2, CP2), (TP2, --sequence-parallel, CP2),
(CP2, DP2, ZeRO-0/2/3), (CP2, PP2), CP4, with ALST's tiling, with activation checkpointing, on packed short
documents, and in fp16 (DeepSpeed's loss scaling) against fp16 in one process; resumes across layouts with the
optimizer state ((TP2, CP2) -> one process and -> CP4); dropout masks differ across CP ranks and a CP2 run with
dropout is reproducible; evaluation of a CP checkpoint; the refusals, one line each, before any work.

Every layout runs in one 4-rank launch, one after the other, and every one-process run in one 1-rank launch:
a launch costs more than a 5-step job."""
import json

import pytest
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from dist import run_distributed
from run_utils import TINY_GPT2, ds_config, write_corpus
from test_checkpoint import args, losses
from test_sequence_parallel_job import NODROP, STEPS, _max_rel, _refusal_worker

from models.parallel import initialize_model_parallel, model_parallel_seed, sequence_chunk_rng, tensor_parallel_rng
from pipeline.checkpoints import universal
from pipeline.evaluate import main as evaluate_main
from pipeline.job.errors import command
from pipeline.pretrain import main

CP = ("--context-parallel", "2")
# name: (arguments after the common ones, DeepSpeed config); each runs on 4 ranks (DP fills the rest)
LAYOUTS = {
    "CP2 DP2": (CP, "ds.json"),
    "TP2 CP2": (CP + ("--tensor-parallel", "2", "--save-interval", "2"), "ds.json"),
    "TP2 SP CP2": (CP + ("--tensor-parallel", "2", "--sequence-parallel"), "ds.json"),
    "CP2 DP2 ZeRO-0": (CP, "ds_z0.json"),
    "CP2 DP2 ZeRO-2": (CP, "ds_z2.json"),
    "CP2 DP2 ZeRO-3": (CP, "ds_z3.json"),
    "CP2 PP2": (CP + ("--pipeline-parallel", "2"), "ds.json"),
    "CP4": (("--context-parallel", "4"), "ds.json"),
    "CP2 DP2 tiled MLP and loss": (CP + ("--tiled-mlp", "2", "--tiled-loss", "4"), "ds.json"),
    "CP2 DP2 activation checkpointing": (CP + ("--activation-checkpointing",), "ds.json"),
}
FP16, PACKED = "CP2 DP2 fp16", "CP2 DP2 packed documents"
DROPOUT = ("CP2 DP2 dropout", "CP2 DP2 dropout again", "CP2 DP2 dropout activation checkpointing")
# name: (arguments, DeepSpeed config, the line's message)
REFUSALS = {"seq 31": (CP + ("--seq-length", "31"), "ds.json", "seq_length 31 is not divisible by context_parallel 2"),
            "ZeRO-3 reduce_scatter": (CP, "ds_z3_rs.json", "zero_optimization.reduce_scatter true with --context-parallel "
                                      "at ZeRO stage 3"),
            "SP seq 30": (CP + ("--tensor-parallel", "2", "--sequence-parallel", "--seq-length", "30"), "ds.json",
                          "seq_length 30 is not divisible by context_parallel x tensor_parallel = 4 (sequence "
                          "parallelism)")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")
    write_corpus(d)
    # packed documents: each at most 15 bytes + its end-of-document token, so every 16-token CP2 chunk of a
    # 32-token sequence holds a document boundary
    docs = [f"x{i} = {i * 7 % 1000}" for i in range(300)]
    assert max(map(len, docs)) <= 15
    (d / "docs.txt").write_text("\n\n".join(docs) + "\n")
    (d / "nodrop.json").write_text(json.dumps(NODROP))
    (d / "model.json").write_text(json.dumps(TINY_GPT2))  # dropout 0.1
    z3_reduce_scatter = ds_config(3)
    z3_reduce_scatter["zero_optimization"]["reduce_scatter"] = True
    for name, ds in (("ds", ds_config()), ("ds_z0", ds_config(0)), ("ds_z2", ds_config(2)), ("ds_z3", ds_config(3)),
                     ("ds_z3_rs", z3_reduce_scatter), ("ds_fp16", ds_config(fp16=True))):
        (d / f"{name}.json").write_text(json.dumps(ds))
    (d / "eval.txt").write_text("def dumps(obj, *, skipkeys=False):\n    return obj\n\nclass JSONDecodeError:\n    pass\n")
    return d


def _argv(setup, name, extra=(), ds="ds.json", model="nodrop.json", steps=STEPS):
    argv = args(setup, setup / name.replace(" ", "_"), steps, "--micro-batch-size", "2", *extra, model=model)
    argv[argv.index("--deepspeed_config") + 1] = str(setup / ds)
    return argv


EVAL = ["--task", "bpc", "--context-length", "32", "--stride", "16", "--no-progress"]
# pipeline.evaluate --checkpoint of the (TP2, CP2) run scored at these layouts on the 4 ranks (a 31-token window:
# padded to a multiple of CP)
EVAL_LAYOUTS = {"TP2 CP2": ("--tensor-parallel", "2", "--context-parallel", "2"), "CP4": ("--context-parallel", "4")}


def _evaluations(setup) -> list[list[str]]:
    return [["--checkpoint", str(setup / "TP2_CP2"), "--data", str(setup / "eval.txt"), *EVAL, *flags,
             "--out", str(setup / f"TP2_CP2 scored at {name}.eval.json".replace(" ", "_"))]
            for name, flags in EVAL_LAYOUTS.items()]


def _jobs_worker(rank, jobs, evaluations):
    """Each ``(name, argv)`` of ``jobs`` in turn (the command-line entry point: a refusal is one line and exit
    status 2), then ``pipeline.evaluate`` of each of ``evaluations``, then the random streams; {name: (exit status,
    stderr)} and the streams' draws."""
    get_accelerator().is_fp16_supported = lambda: True  # the CPU accelerator refuses fp16; its loss scaling is real
    out = {name: _refusal_worker(rank, argv) for name, argv in jobs}
    for argv in evaluations:
        evaluate_main(argv)
    return out, _stream_draws()


def _stream_draws() -> dict:
    """Dropout masks from each stream at (TP1, CP2, DP2) and (TP2, CP2) on these 4 ranks."""
    draws = {}
    for tp in (1, 2):
        initialize_model_parallel(tp, 1, 2)
        model_parallel_seed(1234)
        ones = torch.ones(256)
        with sequence_chunk_rng(False):
            chunk = F.dropout(ones, 0.5)
        with tensor_parallel_rng():
            split = F.dropout(ones, 0.5)
        draws[tp] = {"default": F.dropout(ones, 0.5), "chunk": chunk, "model-parallel": split}
    return draws


@pytest.fixture(scope="module")
def cp_runs(setup):
    jobs = [(f"refused {name}", _argv(setup, f"refused {name}", extra, ds)) for name, (extra, ds, _) in REFUSALS.items()]
    jobs += [(name, _argv(setup, name, extra, ds)) for name, (extra, ds) in LAYOUTS.items()]
    jobs += [(FP16, _argv(setup, FP16, CP, "ds_fp16.json")),
             (PACKED, _argv(setup, PACKED, CP + ("--data", str(setup / "docs.txt")))),
             ("TP2 CP2 -> CP4", _argv(setup, "TP2 CP2 -> CP4", ("--context-parallel", "4", "--load",
                                                               str(setup / "TP2_CP2"), "--load-tag", "global_step2")))]
    jobs += [(name, _argv(setup, name, CP + (("--activation-checkpointing",) if "checkpointing" in name else ()),
                          model="model.json")) for name in DROPOUT]
    results = run_distributed(_jobs_worker, 4, jobs, _evaluations(setup))
    return [r[0] for r in results], [r[1] for r in results]


def _single_worker(rank, jobs, evaluations):
    get_accelerator().is_fp16_supported = lambda: True
    for argv in jobs:
        main(argv)
    for argv in evaluations:
        evaluate_main(argv)
    return 0


@pytest.fixture(scope="module")
def single(setup, cp_runs):
    """The one-process runs: fp32, fp16 and packed documents; the (TP2, CP2) checkpoint resumed at (TP1, CP1);
    ``pipeline.evaluate --checkpoint`` of the (TP2, CP2) run and of the fp32 one."""
    jobs = [_argv(setup, "single", ("--save-interval", "2")), _argv(setup, "single fp16", ds="ds_fp16.json"),
            _argv(setup, "single packed", ("--data", str(setup / "docs.txt"))),
            _argv(setup, "TP2 CP2 -> TP1 CP1", ("--load", str(setup / "TP2_CP2"), "--load-tag", "global_step2"))]
    evaluations = [["--checkpoint", str(setup / run), "--out", str(setup / f"{run}.eval.json"), "--data",
                    str(setup / "eval.txt"), *EVAL] for run in ("TP2_CP2", "single")]
    run_distributed(_single_worker, 1, jobs, evaluations)
    return losses(setup / "single")


def _ok(cp_runs, name):
    for code, err in (rank[name] for rank in cp_runs[0]):
        assert code == 0, err[-3000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_main_job_context_parallel_equals_single_process(setup, cp_runs, single, layout):
    _ok(cp_runs, layout)
    rel = _max_rel(losses(setup / layout.replace(" ", "_")), single)
    print(f"{layout}: max relative loss difference over {STEPS} steps {rel:.2e}")
    assert rel < 1e-6, layout  # (the composition matrix measures <= 1.4e-7 at these layouts)


@pytest.mark.parametrize("layout,reference,tolerance", [(PACKED, "single packed", 1e-5),
                                                        (FP16, "single fp16", 1e-3)])
def test_packed_documents_and_fp16(setup, cp_runs, single, layout, reference, tolerance):
    """Packed documents: positions and the causal mask are those of the unsplit sequence (the project packs
    documents with an end-of-document token between them and no per-document mask, as Megatron by default). fp16:
    the same loss scales and skipped steps as one process, losses within fp16's rounding."""
    _ok(cp_runs, layout)
    got, want = losses(setup / layout.replace(" ", "_")), losses(setup / reference.replace(" ", "_"))
    rel = _max_rel(got, want)
    print(f"{layout}: max relative loss difference over {STEPS} steps vs {reference} {rel:.2e}")
    assert rel < tolerance, (got, want)
    if layout == FP16:
        scales = [[(r["loss_scale"], r["skipped_steps"]) for r in map(json.loads, (setup / run / "metrics.jsonl")
                                                                      .read_text().splitlines()) if "loss" in r]
                  for run in (layout.replace(" ", "_"), "single_fp16")]
        print("fp16 (loss scale, skipped steps):", scales[0])
        assert scales[0] == scales[1]


@pytest.mark.parametrize("saved,resumed", [("TP2 CP2", "TP2 CP2 -> TP1 CP1"), ("TP2 CP2", "TP2 CP2 -> CP4")])
def test_resume_across_layouts_carries_the_optimizer(setup, cp_runs, single, saved, resumed):
    """Saved at step 2, resumed at another layout through the universal path: steps 3-5 follow the uninterrupted
    run (with Adam's moments restarted they would not); the checkpoint's model config does not name CP."""
    if "CP4" in resumed:
        _ok(cp_runs, resumed)
    src = setup / saved.replace(" ", "_")
    assert "context_parallel" not in json.loads((src / "config.json").read_text())
    # the conversion is written into the resumed run's --save, never into the run it reads (docs/runs.md)
    assert universal.cache_path(setup / resumed.replace(" ", "_"), "global_step2").is_dir()
    assert not universal.cache_path(src, "global_step2").exists()
    got = losses(setup / resumed.replace(" ", "_"))
    rel = max(abs(got[s] - single[s]) / single[s] for s in (3, 4, 5))
    print(f"{resumed}: steps 3-5 max relative loss difference {rel:.2e}")
    assert sorted(got) == [3, 4, 5] and rel < 1e-5, (got, single)


def test_evaluate_a_context_parallel_checkpoint(setup, single):
    """``pipeline.evaluate --checkpoint`` of the (TP2, CP2) run (scored at CP 1) equals that of the one-process run."""
    ours, ref = (json.loads((setup / f"{run}.eval.json").read_text())["results"] for run in ("TP2_CP2", "single"))
    print("bpc of the (TP2, CP2) checkpoint", ours, "of the one-process one", ref)
    floats = [k for k, v in ref.items() if isinstance(v, float)]
    assert floats and all(ours[k] == pytest.approx(ref[k], rel=1e-5) for k in floats)


@pytest.mark.parametrize("layout", EVAL_LAYOUTS)
def test_evaluate_at_context_parallel_equals_one_process(setup, single, layout):
    """``pipeline.evaluate --checkpoint --context-parallel C``: each window split over C ranks (with TP, and at CP4)
    scores the (TP2, CP2) run as one process does, per-token losses gathered from the chunks."""
    ref = json.loads((setup / "TP2_CP2.eval.json").read_text())
    got = json.loads((setup / f"TP2_CP2 scored at {layout}.eval.json".replace(" ", "_")).read_text())
    assert got["settings"]["context_parallel"] == int(EVAL_LAYOUTS[layout][-1])
    floats = [k for k, v in ref["results"].items() if isinstance(v, float)]
    rel = max(abs(got["results"][k] - ref["results"][k]) / abs(ref["results"][k]) for k in floats if ref["results"][k])
    print(f"evaluate at {layout}: max relative difference from one process {rel:.1e}")
    assert floats and rel < 1e-5 and got["results"]["num_scored_tokens"] == ref["results"]["num_scored_tokens"]


def test_dropout_masks_differ_across_context_parallel_ranks(setup, cp_runs):
    """The residual-stream stream of a CP rank is its own (the same on its TP peers and data-parallel replicas), as
    is its model-parallel stream; the default stream is the stage's everywhere. A CP2 run with dropout is
    reproducible run to run, also under activation checkpointing (the recomputation redraws the same masks)."""
    for name in DROPOUT:
        _ok(cp_runs, name)
    draws = cp_runs[1]
    tp1, tp2 = ([d[tp] for d in draws] for tp in (1, 2))
    assert all(torch.equal(d["default"], tp1[0]["default"]) for d in tp1 + tp2)
    # (TP1, CP2, DP2): ranks 0, 1 are CP peers, 2 and 3 their data-parallel replicas
    for stream in ("chunk", "model-parallel"):
        assert not torch.equal(tp1[0][stream], tp1[1][stream]) and torch.equal(tp1[0][stream], tp1[2][stream])
    # (TP2, CP2): rank = 2 x cp_rank + tp_rank
    assert torch.equal(tp2[0]["chunk"], tp2[1]["chunk"]) and not torch.equal(tp2[0]["chunk"], tp2[2]["chunk"])
    split = [d["model-parallel"] for d in tp2]
    assert all(not torch.equal(split[i], split[j]) for i in range(4) for j in range(i))
    runs = [losses(setup / name.replace(" ", "_")) for name in DROPOUT]
    nodrop = losses(setup / "CP2_DP2")
    print("CP2 with dropout:", runs[0], "again:", runs[1], "checkpointed:", runs[2])
    assert runs[0] == runs[1] == runs[2] and runs[0] != nodrop


def test_refusals_before_any_work(setup, cp_runs, capsys):
    with pytest.raises(SystemExit) as e:  # refused before the process group is joined: in this process
        command(main)(_argv(setup, "refused CP0", ("--context-parallel", "0")))
    err = capsys.readouterr().err
    assert e.value.code == 2 and not (setup / "refused_CP0").exists(), err
    assert err.strip().startswith("error: ") and "argument --context-parallel: '0' is out of range" in err, err
    assert err.count("error: ") == 1 and "Traceback" not in err
    for name, (*_, message) in REFUSALS.items():
        (code0, err0), *others = (rank[f"refused {name}"] for rank in cp_runs[0])
        assert code0 == 2 and message in err0 and err0.count("error: ") == 1 and "Traceback" not in err0, err0
        assert all(code == 2 and "error: " not in err for code, err in others)  # rank 0 only
        # before any work: at most the run's lock (taken in setup), no config, metrics or checkpoint
        run = setup / f"refused_{name.replace(' ', '_')}"
        assert not run.exists() or not [p for p in run.iterdir() if p.name != ".run.lock"]
