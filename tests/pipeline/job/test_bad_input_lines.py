"""The last rough edges of bad input (issue 25): each is one line ``error: <file/line/field>: ...``, exit code 2,
no traceback, naming the file, line, record or field; torchrun's failure summary carries the same line."""
import json
import os
import shutil
import sys

import pytest
import torch
from cli import run_cli
from conftest import ROOT, shared_data
from run_utils import write_job_files

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo PAYLOAD RAN",))


def pretrain(d, *extra, data="corpus.txt"):
    return ["-m", "pipeline.pretrain", "--model-config", str(d / "model.json"), "--deepspeed_config",
            str(d / "ds.json"), "--data", str(d / data), "--tokenizer", "bytes", "--seq-length", "32",
            "--lr-warmup-steps", "1", "--train-steps", "2", "--cache-dir", str(d / "cache"), *extra]


def finetune(d, train):
    return ["-m", "finetune.train", "--base", str(d / "run"), "--train", str(d / train), "--dev", str(d / "dev.tsv"),
            "--train-steps", "1", "--max-length", "16", "--global-batch-size", "4", "--deepspeed_config",
            str(d / "ds.json")]


def predict(d, data):
    return ["-m", "finetune.predict", "--model", str(d / "clf"), "--data", str(d / data), "--out", str(d / "pred.txt"),
            "--force"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A two-step pretraining run, a classifier finetuned from it, and the doctored inputs."""
    d = tmp_path_factory.mktemp("bad_input")
    write_job_files(d, MODEL, json.__doc__ * 20)
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:21]
    (d / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_cli([sys.executable, *pretrain(d, "--save", str(d / "run"))], d)
    run_cli([sys.executable, *finetune(d, "dev.tsv"), "--save", str(d / "clf")], d)
    (d / "headonly.tsv").write_text(lines[0] + "\n")
    (d / "binary.tsv").write_bytes(bytes(range(256)) * 4)
    (d / "comma.tsv").write_text("\n".join(",".join(line.split("\t")) for line in lines) + "\n")
    (d / "nohead.tsv").write_text("\n".join(lines[1:]) + "\n")
    latin = "\n".join(lines[:2]).encode() + b"\n" + lines[2].replace("a", "\xe9", 1).encode("latin-1") + b"\n"
    (d / "latin1.tsv").write_bytes(latin + ("\n".join(lines[3:]) + "\n").encode())
    (d / "nul.tsv").write_text("\n".join([*lines[:3], lines[3].replace(" ", " \x00", 1), *lines[4:]]) + "\n")
    (d / "adir").mkdir()
    (d / "bad.jsonl").write_text('{"text": "hello there"}\n{"text": "second"}\n{"text": "x"} junk\n')
    (d / "nontext.jsonl").write_text('{"text": "hello there"}\n{"text": {"a": 1}}\n')
    (d / "datadir").mkdir()
    shutil.copy(d / "corpus.txt", d / "datadir" / "a.txt")
    shutil.copytree(d / "run", d / "garbage")
    (d / "garbage" / "latest").write_bytes(b"\xff\xfe\x00garbage\x80")
    shutil.copytree(d / "run", d / "damaged")
    model_file = d / "damaged" / "global_step2" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2, "n_head": 4,
          "n_positions": 32, "vocab_size": 264}
    for name, zip_format in (("hfpickle", True), ("hfold", False)):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(hf))
        torch.save({"x": _Payload()}, d / name / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    return d


# (name, argv, the text the one line must hold)
CASES = [
    ("predict header-only E-c file", lambda d: predict(d, "headonly.tsv"),
     "{d}/headonly.tsv: holds no texts (a header and no rows)"),
    ("predict binary file", lambda d: predict(d, "binary.tsv"), "{d}/binary.tsv: not UTF-8"),
    ("predict --data a directory", lambda d: predict(d, "adir"), "{d}/adir: is a directory; give a data file"),
    ("train comma-separated E-c file", lambda d: finetune(d, "comma.tsv"),
     "{d}/comma.tsv, line 1: the header has no tab (it is separated by ','): E-c files are tab-separated"),
    ("train E-c file without a header", lambda d: finetune(d, "nohead.tsv"),
     "{d}/nohead.tsv, line 1: the first line is a data row, not a header"),
    ("train latin-1 byte on line 3", lambda d: finetune(d, "latin1.tsv"), "{d}/latin1.tsv, line 3: not UTF-8"),
    ("train header-only file", lambda d: finetune(d, "headonly.tsv"),
     "{d}/headonly.tsv: holds no examples (a header and no rows)"),
    ("train NUL byte in a tweet", lambda d: finetune(d, "nul.tsv"), "{d}/nul.tsv, line 4, column 'Tweet': a NUL"),
    ("pretrain latest holds garbage", lambda d: pretrain(d, "--load", str(d / "garbage")),
     "{d}/garbage/latest: holds 11 bytes that are not a tag name (it is damaged)"),
    ("pretrain --load with another tokenizer",
     lambda d: pretrain(d, "--load", str(d / "run"), "--tokenizer", "train-bpe", "--vocab-size", "300"),
     "tokenizer mismatch: {d}/run/tokenizer was trained with tokenizer 'bytes'"),
    ("pretrain --load with other data",
     lambda d: pretrain(d, "--load", str(d / "run"), data=f"datadir/a.txt,{d}/corpus.txt"),
     "--load {d}/run (global_step2): the data loader state does not fit this data"),
    ("pretrain --load a data folder", lambda d: pretrain(d, "--load", str(d / "datadir")),
     "--load {d}/datadir: not a run directory"),
    ("pretrain JSON-lines bad line 3", lambda d: pretrain(d, data="bad.jsonl"),
     "{d}/bad.jsonl: line 3: not one JSON record"),
    ("pretrain non-text field", lambda d: pretrain(d, data="nontext.jsonl"),
     "{d}/nontext.jsonl: field 'text' holds Json values, not text: record 2 is dict"),
    ("import_hf pickled pytorch_model.bin", lambda d: ["-m", "pipeline.import_hf", "--model", str(d / "hfpickle"),
                                                        "--out", str(d / "imported")],
     "{d}/hfpickle/pytorch_model.bin: contains a pickled object of type posix.system, not allowed"),
    ("import_hf old-format pickle", lambda d: ["-m", "pipeline.import_hf", "--model", str(d / "hfold"), "--out",
                                               str(d / "imported")],
     "{d}/hfold/pytorch_model.bin: contains a pickled object of type posix.system, not allowed"),
    ("finetune --base pickled pytorch_model.bin", lambda d: [*finetune(d, "dev.tsv"), "--base", str(d / "hfold"),
                                                             "--save", str(d / "clf_pickle")],
     "{d}/hfold is a Hugging Face model directory ({d}/hfold/config.json names GPT2LMHeadModel), not a checkpoint "
     "of this project; read it with --hf where a command takes one, or import it"),  # never unpickled
    ("evaluate --hf pickled pytorch_model.bin", lambda d: ["-m", "pipeline.evaluate", "--task", "bpc", "--data",
                                                           str(d / "corpus.txt"), "--hf", str(d / "hfpickle"),
                                                           "--out", str(d / "eval.json")],
     "{d}/hfpickle/pytorch_model.bin: contains a pickled object"),
    ("export_hf damaged tag", lambda d: ["-m", "pipeline.export_hf", "--checkpoint", str(d / "damaged"), "--out",
                                         str(d / "exported")],
     "choose another by passing {d}/damaged/<tag> in place of {d}/damaged"),
]


@pytest.mark.parametrize("name,argv,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(work, name, argv, message):
    proc = run_cli([sys.executable, *argv(work)], work, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "[WARNING]" not in line
             and not line.startswith(("Generating", "tokenizing"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "PAYLOAD RAN" not in proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert message.format(d=work) in lines[0], lines[0]
    assert "--load-tag" not in lines[0] or name.startswith("pretrain")


def test_layout_refusal_under_torchrun(work):
    """TP 2 with 3 heads under torchrun's code (``python -m pipeline.launch``): rank 0's one line, then the
    launcher's one line naming the first failed rank, its exit code and its line (from the worker's error file,
    not "To enable traceback"); exit code 2; no traceback of the launcher or of a worker."""
    (work / "m3.json").write_text(json.dumps({**MODEL, "hidden_size": 24, "num_heads": 3}))
    argv = pretrain(work, "--tensor-parallel", "2")[2:]
    argv[argv.index("--model-config") + 1] = str(work / "m3.json")
    proc = run_cli([sys.executable, "-m", "pipeline.launch", "--nproc_per_node", "2", "--master-port", "29731",
                    ROOT / "pipeline" / "pretrain.py", *argv], work, check=False)
    line = ("invalid model config for tensor_parallel=2: num_heads 3 is not divisible by the tensor-parallel size 2; "
            "choose a --tensor-parallel that divides 3")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors[0] == f"error: {line}", proc.stderr[-3000:]
    assert errors[-1].startswith("error: torchrun: rank ") and errors[-1].endswith(f"exit code 2 (2 worker(s) "
                                                                                  f"failed): {line}"), errors
    assert len(errors) == 2 and "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "SIGTERM received" not in proc.stderr  # the agent's stop of rank 1 is not a preemption


def test_the_launcher_names_the_worker_that_exited_not_the_one_it_stopped(tmp_path):
    """Rank 1 wrote its error file first, then the agent stopped it (SIGTERM) when rank 0 exited with 2: the line
    names rank 0 and the job exits 2, not 1 (a signal's); with signals only, the earliest and 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipeline.launch import summary
    exited, stopped = (ProcessFailure(r, 100 + r, code, str(tmp_path / "none")) for r, code in ((0, 2), (1, -15)))
    exited.timestamp, stopped.timestamp = 20, 10
    line, code = summary(ChildFailedError("pretrain.py", {0: exited, 1: stopped}))
    assert code == 2 and line.startswith("error: torchrun: rank 0 (pid 100) failed first, exit code 2"), line
    line, code = summary(ChildFailedError("pretrain.py", {1: stopped}))
    assert code == 1 and "rank 1 (pid 101) failed first, killed by SIGTERM" in line, line
