"""Every command: a user error is one line ``error: ...`` naming the file or field, exit code 2, no traceback;
and nothing a user owns is replaced or deleted (outputs never overwrite inputs; --force replaces only what the
command itself wrote)."""
import hashlib
import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest
from cli import run_cli
from conftest import shared_data
from dist import run_distributed
from run_utils import ds_config

from pipeline.job.files import OutputError, atomic_dir
from pipeline.pretrain import main

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
DS = ds_config(stage=1)


def _pretrain(rank, argv):
    main(argv)
    return 0


def pretrain_args(d, save, *extra, ds="ds.json", data=None):
    return ["-m", "pipeline.pretrain", "--model-config", str(d / "model.json"), "--deepspeed_config", str(d / ds),
            "--data", str(data or d / "corpus.txt"), "--tokenizer", "bytes", "--seq-length", "32",
            "--lr-warmup-steps", "1", "--train-steps", "1", "--cache-dir", str(d / "cache"), "--save", str(save),
            *extra]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A real one-step pretraining run, an E-c slice, and a few doctored inputs."""
    d = tmp_path_factory.mktemp("user_errors")
    (d / "corpus.txt").write_text(inspect.getsource(json))
    (d / "other.txt").write_text(inspect.getsource(inspect))
    (d / "model.json").write_text(json.dumps(MODEL))
    (d / "ds.json").write_text(json.dumps(DS))
    (d / "typo.json").write_text(json.dumps({**DS, "train_batch_sise": 4}))
    run_distributed(_pretrain, 1, pretrain_args(d, d / "run")[2:])
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:21]
    (d / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (d / "comma.tsv").write_text("\n".join(",".join(line.split("\t")) for line in lines) + "\n", encoding="utf-8")
    (d / "nohead.tsv").write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")
    shutil.copytree(d / "run", d / "escaped")
    (d / "escaped" / "latest").write_text("../run/global_step1\n")
    return d


def tree(path: Path) -> dict:
    """Every file under ``path`` with the sha256 of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# (name, argv (format with {d}), the text the one line must hold, the path that must survive unchanged)
CASES = [
    ("pretrain misspelled DeepSpeed key", lambda d: pretrain_args(d, d / "new1", ds="typo.json"),
     "{d}/typo.json: unknown DeepSpeed config key 'train_batch_sise'; did you mean 'train_batch_size'?", None),
    ("pretrain non-finite --data-weights",
     lambda d: pretrain_args(d, d / "new2", "--data-weights", "nan,1", data=f"{d}/corpus.txt,{d}/other.txt"),
     "--data-weights nan,1: each weight must be a finite number", None),
    ("pretrain --load tag outside the run", lambda d: pretrain_args(d, d / "new3", "--load", str(d / "escaped")),
     "{d}/escaped/latest names tag '../run/global_step1', which is not a checkpoint directory inside", "run"),
    ("export_hf --out is the run, --force", lambda d: ["-m", "pipeline.export_hf", "--checkpoint", str(d / "run"),
                                                       "--out", str(d / "run"), "--force"],
     "--out {d}/run is the input --checkpoint {d}/run", "run"),
    ("export_hf --out holds the run, --force", lambda d: ["-m", "pipeline.export_hf", "--checkpoint",
                                                          str(d / "run"), "--out", str(d), "--force"],
     "--out {d} holds the input --checkpoint {d}/run", "run"),
    ("export_hf --out holds another user's files, --force",
     lambda d: ["-m", "pipeline.export_hf", "--checkpoint", str(d / "run"), "--out", str(d / "mine"), "--force"],
     "output directory {d}/mine holds notes.txt, which this command did not write", "mine"),
    ("import_hf --out is --model, --force", lambda d: ["-m", "pipeline.import_hf", "--model", str(d / "run"),
                                                       "--out", str(d / "run"), "--force"],
     "--out {d}/run is the input --model {d}/run", "run"),
    ("evaluate --out is --data", lambda d: ["-m", "pipeline.evaluate", "--task", "bpc", "--data",
                                            str(d / "corpus.txt"), "--checkpoint", str(d / "run"), "--out",
                                            str(d / "corpus.txt")],
     "--out {d}/corpus.txt is the input --data {d}/corpus.txt", "corpus.txt"),
    ("finetune.train --save is --base", lambda d: ["-m", "finetune.train", "--base", str(d / "run"), "--train",
                                                   str(d / "dev.tsv"), "--dev", str(d / "dev.tsv"), "--save",
                                                   str(d / "run")],
     "--save {d}/run is the input --base {d}/run", "run"),
    ("finetune.predict --out is --data", lambda d: ["-m", "finetune.predict", "--model", str(d / "clf"), "--data",
                                                    str(d / "dev.tsv"), "--out", str(d / "dev.tsv"), "--force"],
     "--out {d}/dev.tsv is the input --data {d}/dev.tsv", "dev.tsv"),
    ("finetune.predict existing --out", lambda d: ["-m", "finetune.predict", "--model", str(d / "clf"), "--data",
                                                   str(d / "dev.tsv"), "--out", str(d / "other.txt")],
     "--out {d}/other.txt exists; pass --force to replace it", "other.txt"),
    ("reshard --out is the run, --force", lambda d: ["-m", "pipeline.reshard", "--checkpoint", str(d / "run"),
                                                     "--out", str(d / "run"), "--force"],
     "--out {d}/run is the input --checkpoint {d}/run", "run"),
    ("reshard missing flag", lambda d: ["-m", "pipeline.reshard", "--checkpoint", str(d / "run")],
     "mds-reshard: the following arguments are required: --out; see", None),
    ("export_hf missing flag", lambda d: ["-m", "pipeline.export_hf", "--checkpoint", str(d / "run")],
     "mds-export-hf: the following arguments are required: --out; see", None),
    ("pretrain malformed flag", lambda d: pretrain_args(d, d / "new4", "--tensor-parallel", "two"),
     "argument --tensor-parallel: 'two' is not a whole number", None),
    ("finetune.export_hf --out is --model", lambda d: ["-m", "finetune.export_hf", "--model", str(d / "run"),
                                                       "--out", str(d / "run"), "--force"],
     "--out {d}/run is the input --model {d}/run", "run"),
]


@pytest.mark.parametrize("name,argv,message,survivor", CASES, ids=[c[0] for c in CASES])
def test_user_error_is_one_line(work, name, argv, message, survivor):
    (work / "mine").mkdir(exist_ok=True)
    (work / "mine" / "notes.txt").write_text("a user's own file\n")
    before = tree(work / survivor) if survivor and (work / survivor).is_dir() else None
    before_file = (work / survivor).read_bytes() if survivor and (work / survivor).is_file() else None
    proc = run_cli([sys.executable, *argv(work)], work, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "[WARNING]" not in line
             and not line.startswith(("Generating", "tokenizing"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert message.format(d=work) in lines[0]
    if before is not None:
        assert tree(work / survivor) == before, f"{name}: {survivor} changed"
    if before_file is not None:
        assert (work / survivor).read_bytes() == before_file, f"{name}: {survivor} changed"


def test_force_replaces_only_an_earlier_output(tmp_path):
    """atomic_dir(force=True) replaces a directory it wrote before, never one holding someone else's files."""
    out = tmp_path / "out"
    for text in ("first", "second"):
        with atomic_dir(out, force=True) as tmp:
            (tmp / "model.safetensors").write_text(text)
    assert (out / "model.safetensors").read_text() == "second"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="holds notes.txt, which this command did not write"):
        with atomic_dir(out, force=True) as tmp:
            (tmp / "model.safetensors").write_text("third")
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind
