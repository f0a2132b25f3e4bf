"""``python -m pipeline.generate`` as a user runs it: JSON lines equal to the library's decoding, a single prompt
streamed; the mLSTM generates from its recurrent state (equal to re-reading the text from a zero state); bad input
gets one line and exit status 2; two ranks launched by torchrun at --tensor-parallel 2 write what TP 1 samples (a prompt longer than the context, an empty prompts file, a tokenizer-less run)."""
import json
import sys

import pytest
import torch
from cli import run_cli
from conftest import ROOT
from gen_utils import make_model_dirs

from models import MLSTM, MLSTMConfig
from models.parallel import destroy_model_parallel
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.generation.decode import generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.loading import load_generation_model
from pipeline.generation.sampling import SampleSettings

GENERATE = [sys.executable, "-m", "pipeline.generate"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_cli")
    project, _ = make_model_dirs(root, "llama-gqa")
    torch.manual_seed(0)
    mlstm = MLSTM(MLSTMConfig(vocab_size=258, embed_dim=16, hidden_size=32, seq_length=16, init_range=0.5))
    write_model_dir(mlstm.config, mlstm.state_dict(), root / "mlstm", tokenizer=root / "bytes-tokenizer")
    bare = write_model_dir(mlstm.config, mlstm.state_dict(), root / "no-tokenizer")
    return {"root": root, "gpt": project, "mlstm": root / "mlstm", "bare": bare}


def _library(checkpoint, prompts, settings, use_cache=True):
    destroy_model_parallel()
    model, tok = load_generation_model(checkpoint=checkpoint)
    ids = [tok.encode(p) for p in prompts]
    out = [g.new_ids for g in generate(decoder_for(model, use_cache), ids, settings, eos_id=256)]
    destroy_model_parallel()
    return out


def test_prompts_file_to_json_lines(dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n\n{"prompt": "a\\nb"}\n')
    out = tmp_path / "out.jsonl"
    run_cli([*GENERATE, "--checkpoint", dirs["gpt"], "--prompts", prompts, "--top-k", "20", "--seed", "3",
             "--max-new-tokens", "6", "--out", out], ROOT)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "a\nb"]
    settings = SampleSettings(6, greedy=False, top_k=20, seed=3)
    assert [r["new_ids"] for r in records] == _library(dirs["gpt"], ["Hello", "a\nb"], settings)
    assert all(len(r["new_ids"]) == 6 and r["finish_reason"] == "length" for r in records)
    assert records[0]["prompt_ids"] == list(b"Hello")


def test_torchrun_tp2_writes_what_tp1_samples(dirs, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nab\n")
    out = tmp_path / "tp2.jsonl"
    run_cli([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "pipeline.generate",
             "--checkpoint", dirs["gpt"], "--tensor-parallel", "2", "--prompts", prompts, "--top-p", "0.9",
             "--seed", "7", "--max-new-tokens", "6", "--quiet", "--out", out], ROOT)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    settings = SampleSettings(6, greedy=False, top_p=0.9, seed=7)
    assert [r["new_ids"] for r in records] == _library(dirs["gpt"], ["Hello", "ab"], settings)


def test_mlstm_generates_from_its_state_and_streams(dirs, tmp_path):
    greedy = SampleSettings(12)
    from_state = _library(dirs["mlstm"], ["The ", "xy"], greedy)
    assert from_state == _library(dirs["mlstm"], ["The ", "xy"], greedy, use_cache=False)  # zero state, re-read
    assert len(set(from_state[0])) > 1
    out = tmp_path / "m.jsonl"
    proc = run_cli([*GENERATE, "--checkpoint", dirs["mlstm"], "--prompt", "The ", "--greedy", "--max-new-tokens", "12",
                    "--out", out], ROOT)
    record = json.loads(out.read_text())
    assert record["new_ids"] == from_state[0]
    assert record["completion"] in proc.stdout  # streamed to the terminal


@pytest.mark.parametrize("case, message", [
    ("long", "prompt 1 is 30 tokens, longer than the model's context of 24 positions"),
    ("empty", "the prompts file holds no prompt"),
    ("bare", "has no tokenizer; pass --tokenizer"),
])
def test_refusals_are_one_line(dirs, tmp_path, case, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    args = {"long": ["--checkpoint", dirs["gpt"], "--prompt", "x" * 30],
            "empty": ["--checkpoint", dirs["gpt"], "--prompts", empty],
            "bare": ["--checkpoint", dirs["bare"], "--prompt", "hi"]}[case]
    proc = run_cli([*GENERATE, *args, "--out", tmp_path / "o.jsonl"], ROOT, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o.jsonl").exists()


def test_without_out_the_json_lines_go_to_stdout(dirs, tmp_path):
    """No --out: stdout holds exactly the JSON lines (one prompt's streamed text goes to stderr), nothing written."""
    proc = run_cli([*GENERATE, "--checkpoint", dirs["mlstm"], "--prompt", "The ", "--greedy", "--max-new-tokens",
                    "12"], tmp_path)
    # DeepSpeed's accelerator line goes to stdout at import (issue 45's configuration part silences it)
    records = [json.loads(line) for line in proc.stdout.splitlines() if "[real_accelerator.py" not in line]
    assert len(records) == 1 and records[0]["new_ids"] == _library(dirs["mlstm"], ["The "], SampleSettings(12))[0]
    assert records[0]["completion"] in proc.stderr and "-> stdout" in proc.stderr
    assert list(tmp_path.iterdir()) == []
