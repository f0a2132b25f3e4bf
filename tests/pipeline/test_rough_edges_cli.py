"""Issue 45's rough edges, as a user meets them, in one forked launch: an lm-eval task whose data set would have
to be downloaded while offline is one line naming the task and the remedy; a model imported without a tokenizer
continues with an explicit --tokenizer of its vocabulary, and is refused in one line (with what to pass) without
one or with another; ``mds-pretrain --help`` names the presets' folder; every console script is in the README."""
import json
import tomllib

import pytest
from conftest import ROOT, shared_data
from forked_cli import run_forked
from run_utils import ds_config, write_corpus

from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.data.tokenizer import byte_tokenizer
from pipeline.hf.export import export_hf

pytest.importorskip("lm_eval")
TINY = dict(variant="gpt2", vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=24,
            make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)


def _one_error_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "[real_accelerator.py" not in ln
             and not ln.startswith("[transformers]")]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def test_rough_edges_are_one_line_or_work(tmp_path):
    (tmp_path / "bytes").mkdir()
    byte_tokenizer().save(tmp_path / "bytes")
    initialize_model_parallel(1)
    config = GPTConfig(**TINY)
    full = full_state_dict(GPT(config, init_seed=3))
    destroy_model_parallel()
    write_model_dir(config, full, tmp_path / "gpt", tokenizer=tmp_path / "bytes")
    export_hf(config, full, tmp_path / "hf")  # a Hugging Face directory without tokenizer files
    write_corpus(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(stage=1, train_batch_size=2)))
    imported = tmp_path / "imported"
    job = ["--load", imported, "--deepspeed_config", tmp_path / "ds.json", "--data", tmp_path / "corpus.txt",
           "--seq-length", "16", "--train-steps", "1", "--cache-dir", tmp_path / "cache"]
    results = run_forked([
        ("pipeline.evaluate", ["--harness", "arc_easy", "--checkpoint", tmp_path / "gpt", "--out", tmp_path / "r.json"]),
        ("pipeline.import_hf", ["--model", tmp_path / "hf", "--out", imported]),
        ("pipeline.pretrain", [*job, "--save", tmp_path / "continued", "--tokenizer", "bytes"]),
        ("pipeline.pretrain", job),
        ("pipeline.pretrain", [*job, "--tokenizer", shared_data("tokenizers", "gpt2")]),
        ("pipeline.pretrain", ["--help"]),
    ], tmp_path, timeout=300)
    imported_run = results[1]
    line = _one_error_line(results[0][0], results[0][2])
    assert "--harness arc_easy" in line and "allenai/ai2_arc" in line and "HF_DATASETS_OFFLINE" in line, line
    assert "--include-path" in line and not (tmp_path / "r.json").exists()
    assert imported_run[0] == 0 and not list(imported.glob("tokenizer*")), imported_run[2][-2000:]
    continued = results[2]
    assert continued[0] == 0, continued[2][-3000:]
    assert (tmp_path / "continued" / "tokenizer" / "tokenizer.json").is_file()
    missing = _one_error_line(results[3][0], results[3][2])
    assert "has no tokenizer" in missing and "--tokenizer DIR" in missing and "258 tokens" in missing, missing
    other = _one_error_line(results[4][0], results[4][2])
    assert "50257 tokens" in other and "vocab_size 258" in other, other
    assert "models/configs/" in results[5][1]
    readme = (ROOT / "README.md").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert [s for s in scripts if f"| `{s}` |" not in readme] == []
