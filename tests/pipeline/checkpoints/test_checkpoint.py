"""Exact resume (also after kill -9 during a save), kill -9 of every conversion, damaged checkpoints, resharding
to other layouts."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli import cli_env
from dist import run_distributed
from run_utils import NO_DROPOUT, TINY_GPT2, ds_config, pretrain_worker, write_corpus
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import GPT
from pipeline.checkpoints import checkpoint, universal
from pipeline.checkpoints.model_dir import read_model_dir
from pipeline.evaluate import main as evaluate_main
from pipeline.export_hf import main as export_main
from pipeline.import_hf import main as import_main
from pipeline.reshard import main as reshard_main
from pipeline.checkpoints.state_dicts import load_full_state_dict, read_state_dict

MODEL = TINY_GPT2
DS = ds_config(stage=1)
_pretrain = pretrain_worker


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    write_corpus(d)
    (d / "model.json").write_text(json.dumps(MODEL))
    (d / "nodrop.json").write_text(json.dumps({**MODEL, **NO_DROPOUT}))
    (d / "ds.json").write_text(json.dumps(DS))
    return d


def args(d, save, steps, *extra, model="model.json"):
    return ["--model-config", str(d / model), "--deepspeed_config", str(d / "ds.json"), "--data", str(d / "corpus.txt"),
            "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "2", "--train-steps", str(steps),
            "--cache-dir", str(d / "cache"), "--save", str(save), *extra]


def losses(save):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(save) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(setup):
    save = setup / "full"
    run_distributed(_pretrain, 2, args(setup, save, 6, "--save-interval", "3", "--tensor-parallel", "2"))
    return save


def test_resume_is_exact(setup, uninterrupted):
    resumed = setup / "resumed"
    run_distributed(_pretrain, 2, args(setup, resumed, 6, "--load", str(uninterrupted), "--load-tag", "global_step3",
                                       "--tensor-parallel", "2"))
    full, res = losses(uninterrupted), losses(resumed)
    assert sorted(res) == [4, 5, 6]
    print("uninterrupted", [full[s] for s in (4, 5, 6)], "resumed", [res[s] for s in (4, 5, 6)])
    for s in (4, 5, 6):
        assert res[s] == full[s], f"step {s}: {res[s]!r} != {full[s]!r}"  # to the last bit (fp32, dropout on)


def test_kill_during_save_leaves_previous_checkpoint(setup, uninterrupted):
    save = setup / "killed"
    with pytest.raises(Exception, match="SIGKILL|signal"):
        run_distributed(_pretrain, 2, args(setup, save, 6, "--save-interval", "2", "--tensor-parallel", "2"),
                        env={"PIPELINE_CRASH_AT": "after-deepspeed-files:4"})
    assert (save / "latest").read_text().strip() == "global_step2"
    assert (save / "global_step4").is_dir() and not (save / "global_step4" / checkpoint.COMPLETE).exists()
    with pytest.raises(checkpoint.CheckpointError, match="global_step4 is incomplete"):
        checkpoint.resolve_tag(save, "global_step4")
    resumed = setup / "after_kill"
    run_distributed(_pretrain, 2, args(setup, resumed, 6, "--load", str(save), "--tensor-parallel", "2"))
    full, res = losses(uninterrupted), losses(resumed)
    assert sorted(res) == [3, 4, 5, 6]
    for s in res:
        assert res[s] == full[s], f"step {s}"



# -- asynchronous saves (--async-save, pipeline/checkpoints/async_save.py) ------------------------------------------

def _manifest(save, tag):
    return json.loads((Path(save) / tag / checkpoint.COMPLETE).read_text())["files"]


def test_async_save_writes_the_bytes_of_a_synchronous_save(setup, uninterrupted):
    """The run of ``uninterrupted`` (TP 2, dropout on) saved with --async-save, each write delayed 1 s so that
    steps 4 and 5 change the weights and Adam moments while step 3's is pending: every file of both tags has the
    size and sha256 of the synchronous save's (the manifests are equal: what is written is the snapshot of the
    step), so a resume reads the same bytes. (The kill test below is the one that needs the write in flight.)"""
    save = setup / "async"
    run_distributed(_pretrain, 2, args(setup, save, 6, "--save-interval", "3", "--tensor-parallel", "2",
                                       "--async-save"), env={"PIPELINE_ASYNC_SAVE_DELAY_S": "1"})
    assert (save / "latest").read_text() == "global_step6\n"
    for tag in ("global_step3", "global_step6"):
        assert _manifest(save, tag) == _manifest(uninterrupted, tag), tag
    assert losses(save) == losses(uninterrupted)
    _, got, _ = checkpoint.read_full_checkpoint(save, "global_step3")  # what export_hf and evaluate read
    _, want, _ = checkpoint.read_full_checkpoint(uninterrupted, "global_step3")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_kill_during_an_async_write_leaves_the_previous_tag_latest(setup, uninterrupted):
    """kill -9 of both ranks at the boundary of step 5 while the write of step 4 is in flight (each write delayed
    2 s; the crash point fires only while a write is in flight): latest still names the async-saved step 2, step
    4 is no complete tag, and --load continues from step 2 with the losses of the uninterrupted run, to the bit."""
    save = setup / "async_killed"
    with pytest.raises(Exception, match="SIGKILL|signal"):
        run_distributed(_pretrain, 2, args(setup, save, 6, "--save-interval", "2", "--tensor-parallel", "2",
                                           "--async-save"),
                        env={"PIPELINE_CRASH_AT": "async-save-in-flight:5", "PIPELINE_ASYNC_SAVE_DELAY_S": "2"})
    assert (save / "latest").read_text().strip() == "global_step2"
    assert checkpoint.complete_tags(save) == ["global_step2"]
    assert sorted(losses(save)) == [1, 2, 3, 4]  # step 4 ran and its write began; step 5's record never came
    resumed = setup / "async_resumed"
    run_distributed(_pretrain, 2, args(setup, resumed, 6, "--load", str(save), "--tensor-parallel", "2"))
    full, res = losses(uninterrupted), losses(resumed)
    assert sorted(res) == [3, 4, 5, 6] and all(res[s] == full[s] for s in res), (res, full)


def test_stop_signal_waits_for_the_async_write_in_flight(setup):
    """SIGTERM to both ranks after step 3 while the write of step 2 is in flight (delayed 2 s): the stop's save of
    step 3 waits for it, writes its own, and the job ends normally with both tags complete and latest at step 3."""
    save = setup / "async_stopped"
    run_distributed(_pretrain, 2, args(setup, save, 6, "--save-interval", "2", "--tensor-parallel", "2",
                                       "--async-save"),
                    env={"PIPELINE_SIGNAL_AT": "3", "PIPELINE_ASYNC_SAVE_DELAY_S": "2"})
    assert (save / "latest").read_text() == "global_step3\n"
    assert checkpoint.complete_tags(save) == ["global_step2", "global_step3"]
    assert checkpoint.resolve_tag(save) == "global_step3" and sorted(losses(save)) == [1, 2, 3]



def _killed_at(where: str, command: list, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``command`` (a module and its arguments) in a process of its own that kills itself (SIGKILL) at
    ``where`` (``pipeline.job.files.crash_point``)."""
    proc = subprocess.run([sys.executable, "-m", *map(str, command)], cwd=cwd, env=cli_env(PIPELINE_CRASH_AT=where),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, f"{command[0]} was not killed at {where}: {proc.stderr[-2000:]}"
    return proc


def test_kill_at_any_point_of_a_conversion_then_the_same_command_succeeds(setup, uninterrupted, tmp_path):
    """kill -9 of export_hf, import_hf, reshard and the universal conversion inside --load, each when its output
    is complete under its temporary name (and export_hf --force when the earlier export is moved aside): no
    output, or none that any reader takes for complete; the same command run again succeeds."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    hf, imported, resharded = tmp_path / "hf", tmp_path / "imported", tmp_path / "resharded"
    commands = {"export_hf": (export_main, ["--checkpoint", run, "--out", hf], hf),
                "import_hf": (import_main, ["--model", hf, "--out", imported], imported),
                "reshard": (reshard_main, ["--checkpoint", run, "--out", resharded], resharded)}
    for name, (main, argv, out) in commands.items():
        _killed_at(f"written:{out.name}", [f"pipeline.{name}", *argv], tmp_path)
        assert not out.exists() and list(tmp_path.glob(f".{out.name}.tmp-*")), name
        assert main([str(a) for a in argv]) == 0  # the same command again (in this process: no launcher)
    _killed_at(f"moved-aside:{hf.name}", ["pipeline.export_hf", *commands["export_hf"][1], "--force"], tmp_path)
    assert not hf.exists()  # the earlier export is aside under a temporary name: no half-new, half-old output
    assert export_main([str(a) for a in commands["export_hf"][1]] + ["--force"]) == 0
    assert AutoModelForCausalLM.from_pretrained(hf) is not None
    _, got, _ = read_model_dir(imported)
    _, want, _ = checkpoint.read_full_checkpoint(run)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert checkpoint.resolve_tag(resharded) == "global_step6"

    # --load at TP1 of the TP2 run converts it on rank 0, into the run being written (--save), not the one read
    cache = tmp_path / "tp1" / "universal" / "global_step6"
    load = args(setup, tmp_path / "tp1", 7, "--load", str(run))
    killed = _killed_at(f"written:{cache.name}", ["pipeline.pretrain", *load], setup)
    said = killed.stdout  # what is converted and where, in one line; DeepSpeed's conversion bars named
    assert "universal checkpoint: merge the shards of each parameter" in killed.stderr, killed.stderr[-2000:]
    assert f"resuming {run} global_step6 (saved at TP 2, PP 1, DP 1, EP 1, ZeRO 1) at TP 1, PP 1, DP 1, EP 1, " \
           f"ZeRO 1: its optimizer state goes through the universal checkpoint {cache} (converted now)" in said, said
    assert not cache.exists()
    run_distributed(_pretrain, 1, load)
    assert (cache / universal.MANIFEST).is_file() and sorted(losses(tmp_path / "tp1")) == [7]
    assert not (run / "universal").exists()

def test_damaged_checkpoint_is_refused(setup, uninterrupted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(uninterrupted, copy)
    victim = copy / "global_step6" / "mp_rank_01_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=r"mp_rank_01_model_states.pt has 100 bytes.*truncated"):
        checkpoint.resolve_tag(copy)
    (copy / "global_step3" / "rank1_state.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"rank1_state.pt is missing"):
        checkpoint.resolve_tag(copy, "global_step3")
    with pytest.raises(checkpoint.CheckpointError, match="complete checkpoints: global_step3, global_step6"):
        checkpoint.resolve_tag(copy)


# -- resharding ---------------------------------------------------------------------------------------------

LAYOUTS = {"1x1": ("1", "1", 1), "2x1": ("2", "1", 2), "1x2": ("1", "2", 2), "2x2": ("2", "2", 4)}


def _run_layout(setup, save, layout, steps, *extra):
    tp, pp, world = LAYOUTS[layout]
    run_distributed(_pretrain, world, args(setup, save, steps, "--tensor-parallel", tp, "--pipeline-parallel", pp,
                                           "--micro-batch-size", "2", *extra, model="nodrop.json"))


@pytest.fixture(scope="module")
def sources(setup):
    """Runs at (1,1) and (TP2, PP2) that save at step 2 and go on to step 3."""
    out = {}
    for layout in ("1x1", "2x2"):
        save = setup / f"src_{layout}"
        _run_layout(setup, save, layout, 3, "--save-interval", "2")
        out[layout] = save
    return out


@pytest.mark.parametrize("source,target", [("1x1", "2x1"), ("2x2", "1x1"), ("2x2", "2x1"), ("2x2", "1x2")])
def test_reshard_first_loss(setup, sources, source, target):
    """TP 1->2, (TP2,PP2)->(1,1), PP 2->1 (at TP 2), TP 2->1 (at PP 2): the first loss after loading
    equals the source layout's loss on the same batch."""
    save = setup / f"reshard_{source}_{target}"
    _run_layout(setup, save, target, 3, "--load", str(sources[source]), "--load-tag", "global_step2")
    want, got = losses(sources[source])[3], losses(save)[3]
    print(f"reshard {source} -> {target}: step-3 loss {got!r} vs {want!r}, rel {abs(got - want) / want:.2e}")
    assert abs(got - want) / want < 1e-5


LLAMA = {"variant": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "max_position_embeddings": 32, "tie_embeddings": False, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_export_from_tp2_pp2_checkpoint(setup, sources, tmp_path, variant):
    """A (TP2, PP2) DeepSpeed run directory -> Hugging Face: same logits and greedy continuation."""

    if variant == "gpt2":
        src = sources["2x2"]
    else:
        (setup / "llama.json").write_text(json.dumps(LLAMA))
        src = setup / "src_llama_2x2"
        run_distributed(_pretrain, 4, args(setup, src, 2, "--tensor-parallel", "2", "--pipeline-parallel", "2",
                                           "--micro-batch-size", "2", model="llama.json"))
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(src), "--out", str(out)]) == 0
    config, full, _ = checkpoint.read_full_checkpoint(src)
    model = GPT(config).eval()
    load_full_state_dict(model, full)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[variant]
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("def load(p):")])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        print(f"{variant} export from TP2xPP2: max relative logit difference {rel:.2e}")
        assert rel < 1e-4
        greedy = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id or 0)
        assert torch.equal(greedy, model.generate(ids, 8))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoints_stay_deepspeed_checkpoints(setup, tmp_path, stage):
    """DeepSpeed's own zero_to_fp32 (its module: the run's zero_to_fp32.py is the project's) recovers the weights of
    a ZeRO-2/3 run (DP=2), equal to ours."""
    ds = {**DS, "zero_optimization": {"stage": stage}}
    (setup / f"ds_z{stage}.json").write_text(json.dumps(ds))
    save = tmp_path / "run"
    argv = args(setup, save, 2, model="nodrop.json")
    argv[argv.index("--deepspeed_config") + 1] = str(setup / f"ds_z{stage}.json")
    run_distributed(_pretrain, 2, argv)
    out = tmp_path / "fp32"
    subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(save), str(out), "--tag", "global_step2"],
                   check=True, capture_output=True)
    theirs = dict(read_state_dict(next(out.glob("*.safetensors")) if list(out.glob("*.safetensors"))
                                  else next(out.glob("*.bin"))))
    _, ours, _ = checkpoint.read_full_checkpoint(save)
    # DeepSpeed's tool keeps the padded vocabulary rows; ours drops them
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name][:value.shape[0]], value, rtol=0, atol=0, msg=name)


def _evaluate(rank, argv):
    from pipeline.evaluate import main
    main(argv)
    return 0


def test_evaluate_checkpoint_at_tp2_equals_its_hf_export(setup, sources, tmp_path):
    """python -m pipeline.evaluate --checkpoint (a TP2xPP2 run, scored at TP=2) == --hf of its export."""
    text = tmp_path / "heldout.txt"
    text.write_text("def dumps(obj, *, skipkeys=False):\n    return obj\n\nclass JSONDecodeError(ValueError):\n    pass\n")
    assert export_main(["--checkpoint", str(sources["2x2"]), "--out", str(tmp_path / "hf")]) == 0
    common = ["--task", "bpc", "--data", str(text), "--context-length", "32", "--stride", "16", "--no-progress"]
    run_distributed(_evaluate, 2, ["--checkpoint", str(sources["2x2"]), "--tensor-parallel", "2",
                                   "--out", str(tmp_path / "ours.json"), *common])
    evaluate_main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "hf.json"), *common])
    ours, theirs = (json.loads((tmp_path / f).read_text()) for f in ("ours.json", "hf.json"))
    print("bpc project TP=2", ours["results"], "hf", theirs["results"])
    assert ours["settings"]["tensor_parallel"] == 2
    for key, value in theirs["results"].items():
        if isinstance(value, float):
            assert ours["results"][key] == pytest.approx(value, rel=1e-5), key
