"""Hostile and careless inputs (issue 46), table-driven through the command lines: each is refused in one line
``error: ...`` naming the file or flag, exit code 2, no traceback, and what the user owns is unchanged. The lines
run through ``forked_cli`` (one Python start, a fork per line)."""
import json
import os
import pickle
import shutil
import struct
import sys

import pytest
from cli import run_cli
from conftest import shared_data
from dist import run_distributed
from forked_cli import run_forked
from run_utils import write_job_files

from pipeline.checkpoints.checkpoint import check_save_dir
from pipeline.job.files import OutputError
from pipeline.pretrain import main as pretrain_main

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
USER_TEXT = "a user's own file\n"


def pretrain(d, save, *extra):
    return ["--model-config", d / "model.json", "--deepspeed_config", d / "ds.json", "--data", d / "corpus.txt",
            "--tokenizer", "bytes", "--seq-length", "32", "--lr-warmup-steps", "1", "--train-steps", "1",
            "--cache-dir", d / "cache", "--save", save, *extra]


def _pretrain(rank, argv):
    pretrain_main([str(a) for a in argv])
    return 0


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A one-step ZeRO-1 run (it has DeepSpeed's zero_to_fp32.py), a classifier finetuned from it, a user's file,
    and copies of the run with links to that file."""
    d = tmp_path_factory.mktemp("hostile")
    write_job_files(d, MODEL, json.__doc__ * 20)
    run_distributed(_pretrain, 1, pretrain(d, d / "run"))
    run_distributed(_pretrain, 1, [*pretrain(d, d / "damaged-latest"), "--train-steps", "2", "--save-interval", "1"])
    victim = d / "damaged-latest" / "global_step2" / "mp_rank_00_model_states.pt"  # global_step1: the backup
    victim.write_bytes(victim.read_bytes()[:100])
    (d / "moe.json").write_text(json.dumps({**MODEL, "num_experts": 4, "moe_top_k": 2}))
    run_distributed(_pretrain, 1, [*pretrain(d, d / "moerun"), "--model-config", d / "moe.json"])
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:21]
    (d / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_cli([sys.executable, "-m", "finetune.train", "--base", d / "run", "--train", d / "dev.tsv", "--dev",
             d / "dev.tsv", "--train-steps", "1", "--max-length", "16", "--global-batch-size", "4",
             "--deepspeed_config", d / "ds.json", "--save", d / "clf"], d)
    (d / "mine.txt").write_text(USER_TEXT)
    for name in ("zero_to_fp32.py", ".run.lock", "metrics.jsonl", "latest"):
        link = d / f"link-{name.strip('.')}"
        shutil.copytree(d / "run", link, symlinks=True)
        (link / name).unlink(missing_ok=True)
        (link / name).symlink_to(d / "mine.txt")
    shutil.copytree(d / "run", d / "hardlink")
    (d / "hardlink" / "metrics.jsonl").unlink()
    os.link(d / "mine.txt", d / "hardlink" / "metrics.jsonl")
    run_cli([sys.executable, "-m", "pipeline.export_hf", "--checkpoint", d / "run", "--out", d / "hf"], d)
    make_lying_files(d)
    return d


def _safetensors_with(path, entry: dict) -> None:
    """A one-tensor safetensors file whose header says ``entry`` over 16 bytes of data."""
    header = json.dumps({"w": entry}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))


def make_lying_files(d) -> None:
    """Files that are not what they claim: configs, GGUF, safetensors, ensembles."""
    (d / "notjson.json").write_text("{'variant': 'gpt2',")
    (d / "list.json").write_text("[1, 2]")
    (d / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01\x00")
    (d / "huge.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0) + bytes(64))
    (d / "keys.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40) + bytes(64))
    for name, entry in (("past_end", {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 20]}),
                        ("overflow", {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]})):
        shutil.copytree(d / "hf", d / name)
        _safetensors_with(d / name / "model.safetensors", entry)
    ens = d / "ensemble"
    (ens / "members").mkdir(parents=True)
    (ens / "ensemble.json").write_text("{not json")
    for name, members in (("ens_ints", [1, 2]), ("ens_empty", [])):
        (d / name).mkdir()
        (d / name / "ensemble.json").write_text(json.dumps({"format": "finetune.ensemble/v1", "members": members,
                                                            "label_names": ["a"]}))
    tfidf = {"format": "finetune.tfidf/v1", "label_names": ["anger"], "normalizer": None, "features": []}
    (d / "tfidf_pickle").mkdir()
    (d / "tfidf_pickle" / "tfidf.json").write_text(json.dumps(tfidf))
    (d / "tfidf_pickle" / "tfidf.safetensors").write_bytes(pickle.dumps({"coef": [1.0]}))
    (d / "tfidf_bad").mkdir()
    (d / "tfidf_bad" / "tfidf.json").write_text(json.dumps({**tfidf, "features": [{"params": 3}]}))
    _safetensors_with(d / "tfidf_bad" / "tfidf.safetensors", {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})


def _resume(name):
    return lambda d: ("pipeline.pretrain", pretrain(d, d / name, "--load", d / name, "--train-steps", "2"))


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "[WARNING]" not in line
            and not line.startswith(("Generating", "tokenizing", "W1", "  warnings.warn"))
            and "Warning" not in line]


# (name, (module, argv) of {d}, the text the one line must hold)
DATA_LOSS = [
    ("resume with zero_to_fp32.py linked outside", _resume("link-zero_to_fp32.py"),
     "{d}/link-zero_to_fp32.py/zero_to_fp32.py is a link to {d}/mine.txt, outside the run directory"),
    ("resume with .run.lock linked outside", _resume("link-run.lock"),
     "{d}/link-run.lock/.run.lock is a link to {d}/mine.txt, outside the run directory"),
    ("resume with metrics.jsonl linked outside", _resume("link-metrics.jsonl"),
     "{d}/link-metrics.jsonl/metrics.jsonl is a link to {d}/mine.txt, outside the run directory"),
    ("resume with latest linked outside", _resume("link-latest"),
     "{d}/link-latest/latest is a link to {d}/mine.txt, outside the run directory"),
    ("resume with metrics.jsonl hard-linked", _resume("hardlink"),
     "{d}/hardlink/metrics.jsonl has 2 hard links; the run writes it in place"),
    ("generate --out RUN/latest --force",
     lambda d: ("pipeline.generate", ["--checkpoint", d / "run", "--prompt", "x", "--out", d / "run" / "latest",
                                      "--force"]),
     "--out {d}/run/latest is a file of the input --checkpoint {d}/run; --force replaces an earlier output, never"),
    ("evaluate --out RUN/config.json --force",
     lambda d: ("pipeline.evaluate", ["--task", "bpc", "--data", d / "corpus.txt", "--checkpoint", d / "run",
                                      "--out", d / "run" / "config.json", "--force"]),
     "--out {d}/run/config.json is a file of the input --checkpoint {d}/run"),
    ("predict --out CLASSIFIER/classifier.json --force",
     lambda d: ("finetune.predict", ["--model", d / "clf", "--data", d / "dev.tsv", "--out",
                                     d / "clf" / "classifier.json", "--force"]),
     "--out {d}/clf/classifier.json is a file of the input --model {d}/clf"),
    ("export_hf --out RUN/tokenizer --force",
     lambda d: ("pipeline.export_hf", ["--checkpoint", d / "run", "--out", d / "run" / "tokenizer", "--force"]),
     "--out {d}/run/tokenizer is a file of the input --checkpoint {d}/run"),
]


def tree(path):
    """Every entry under ``path``: a file's bytes, a link's target."""
    return {str(p.relative_to(path)): os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def check_refusals(d, cases):
    survivors = {name: tree(d / name) for name in ("run", "clf")}
    results = run_forked([case(d) for _, case, _ in cases], d)
    failures = []
    for (name, _, message), (code, out, err) in zip(cases, results):
        lines = _lines(err)
        if code != 2 or "Traceback" in err or len(lines) != 1 or message.format(d=d) not in lines[0]:
            failures.append(f"{name}: exit {code}: {lines[-1] if lines else ''}\n{err[-1500:]}")
        else:
            print(f"{name}: {lines[0]}")  # the report's table: each case and the line a user sees
    assert not failures, "\n\n".join(failures)
    assert (d / "mine.txt").read_text() == USER_TEXT
    assert {name: tree(d / name) for name in survivors} == survivors


def test_data_loss_refused(work):
    check_refusals(work, DATA_LOSS)


def _plan(*extra):
    return lambda d: ("pipeline.plan", ["--model-config", d / "model.json", "--gpus", "8", *extra])


def _generate(*extra):
    return lambda d: ("pipeline.generate", ["--checkpoint", d / "run", "--prompt", "x", "--out", d / "g.txt",
                                            *extra])


def _finetune(*extra, base="run"):
    return lambda d: ("finetune.train", ["--base", d / base, "--train", d / "dev.tsv", "--dev", d / "dev.tsv",
                                         "--train-steps", "1", "--deepspeed_config", d / "ds.json", "--save",
                                         d / "clf_new", *extra])


def _evaluate_hf(model):
    return lambda d: ("pipeline.evaluate", ["--task", "bpc", "--data", d / "corpus.txt", "--hf", d / model,
                                            "--out", d / "e.json"])


def _predict(model):
    return lambda d: ("finetune.predict", ["--model", d / model, "--data", d / "dev.tsv", "--out", d / "p.txt"])


NUMBERS = [
    ("plan --gpus 10^12", _plan("--gpus", "1000000000000"),
     "argument --gpus: '1000000000000' is out of range: give a whole number from 1 to 1048576"),
    ("plan --sustained-tflops nan", _plan("--sustained-tflops", "nan"),
     "argument --sustained-tflops: 'nan' is not a finite number"),
    ("plan --bucket 1e400", _plan("--bucket", "1e400"), "argument --bucket: '1e400' is not a finite number"),
    ("plan --global-batch-size 0", _plan("--global-batch-size", "0"), "argument --global-batch-size: '0' is out"),
    ("plan --micro-batch -2", _plan("--micro-batch", "-2"), "argument --micro-batch: '-2' is out of range"),
    ("generate --temperature inf", _generate("--temperature", "inf"),
     "argument --temperature: 'inf' is not a finite number"),
    ("generate --top-p 1.5", _generate("--top-p", "1.5"),
     "argument --top-p: '1.5' is out of range: give a finite number > 0 and <= 1"),
    ("generate --top-k 0", _generate("--top-k", "0"), "argument --top-k: '0' is out of range"),
    ("generate --max-new-tokens abc", _generate("--max-new-tokens", "abc"),
     "argument --max-new-tokens: 'abc' is not a whole number"),
    ("evaluate --batch-size 0", lambda d: ("pipeline.evaluate", ["--task", "bpc", "--data", d / "corpus.txt",
                                                                 "--checkpoint", d / "run", "--out", d / "e.json",
                                                                 "--batch-size", "0"]),
     "argument --batch-size: '0' is out of range"),
    ("finetune --lr nan", _finetune("--lr", "nan"), "argument --lr: 'nan' is not a finite number"),
    ("finetune --dropout 1", _finetune("--dropout", "1"), "argument --dropout: '1' is out of range"),
    ("predict --threshold 2", lambda d: ("finetune.predict", ["--model", d / "clf", "--data", d / "dev.tsv",
                                                              "--out", d / "p.txt", "--threshold", "2"]),
     "argument --threshold: '2' is out of range: give a finite number >= 0 and <= 1"),
    ("launch --nproc_per_node 0", lambda d: ("pipeline.launch", ["--nproc_per_node", "0", "x.py"]),
     "argument --nproc_per_node: '0' is out of range: give a whole number from 1 to 1024"),
    ("launch --nproc_per_node abc", lambda d: ("pipeline.launch", ["--nproc_per_node", "abc", "x.py"]),
     "argument --nproc_per_node: 'abc' is not a whole number (or one of auto, cpu, gpu, xpu)"),
    ("pretrain --valid-fraction nan", lambda d: ("pipeline.pretrain", pretrain(d, d / "new", "--valid-fraction",
                                                                               "nan")),
     "argument --valid-fraction: 'nan' is not a finite number"),
]

FILES = [
    ("plan: a model config that is not JSON", lambda d: ("pipeline.plan", ["--model-config", d / "notjson.json",
                                                                           "--gpus", "8"]),
     "--model-config {d}/notjson.json: not JSON (line 1, column 2"),
    ("plan: a model config that is a list", lambda d: ("pipeline.plan", ["--model-config", d / "list.json",
                                                                         "--gpus", "8"]),
     "--model-config {d}/list.json: holds a JSON list, not an object"),
    ("plan: an MoE config", lambda d: ("pipeline.plan", ["--model-config", d / "moe.json", "--gpus", "8"]),
     "{d}/moe.json: num_experts 4: the planner models dense layers only"),
    ("GGUF cut inside its header", _evaluate_hf("cut.gguf"), "{d}/cut.gguf: cut inside its header (10 bytes)"),
    ("GGUF declaring 2^40 tensors", _evaluate_hf("huge.gguf"),
     "{d}/huge.gguf: its header declares 1099511627776 tensors and 0 keys, more than its 88 bytes can hold"),
    ("GGUF declaring 2^40 keys", lambda d: ("pipeline.import_hf", ["--model", d / "keys.gguf", "--out", d / "i"]),
     "{d}/keys.gguf: its header declares 0 tensors and 1099511627776 keys"),
    ("safetensors offsets past the end", _evaluate_hf("past_end"),
     "weights file {d}/past_end/model.safetensors is not a readable safetensors file: w (shape [4], F32) at bytes "
     "0..1048576 does not fit"),
    ("safetensors shape overflow", _evaluate_hf("overflow"),
     "weights file {d}/overflow/model.safetensors is not a readable safetensors file: w (shape "
     "[4611686018427387904, 4611686018427387904], F32)"),
    ("ensemble.json not JSON", _predict("ensemble"), "{d}/ensemble/ensemble.json: not valid JSON"),
    ("ensemble.json members not names", _predict("ens_ints"),
     "{d}/ens_ints/ensemble.json: field 'members' is not a list of names ([1, 2])"),
    ("ensemble.json no members", _predict("ens_empty"), "{d}/ens_empty/ensemble.json: field 'members' is not"),
    ("TF-IDF weights a pickle", _predict("tfidf_pickle"),
     "{d}/tfidf_pickle/tfidf.safetensors: not a safetensors file"),
    ("TF-IDF tfidf.json malformed", _predict("tfidf_bad"), "{d}/tfidf_bad: tfidf.json or tfidf.safetensors is malformed ("),
    ("generate --checkpoint a classifier",
     lambda d: ("pipeline.generate", ["--checkpoint", d / "clf", "--prompt", "x", "--out", d / "g.txt"]),
     "{d}/clf is a finetuned classifier (classifier.json), not a language-model checkpoint; its predictions come "
     "from python -m finetune.predict --model {d}/clf"),
    ("export_hf of an ensemble", lambda d: ("pipeline.export_hf", ["--checkpoint", d / "ens_ints", "--out",
                                                                    d / "x"]),
     "{d}/ens_ints is an ensemble of finetuned classifiers (ensemble.json), not a language-model checkpoint"),
    ("export_hf of a GPT-2 MoE run", lambda d: ("pipeline.export_hf", ["--checkpoint", d / "moerun", "--out",
                                                                        d / "x"]),
     "no Hugging Face family holds this gpt2 model (qkv_bias=False, qk_norm=False, bias=True, sliding_window=None, "
     "num_experts=4); no transformers class computes it"),
    ("finetune --base a Hugging Face export", _finetune(base="hf"),
     "{d}/hf is a Hugging Face model directory ({d}/hf/config.json names GPT2LMHeadModel), not a checkpoint of "
     "this project; read it with --hf where a command takes one, or import it with python -m pipeline.import_hf"),
    ("resume: the tag latest names damaged beside a complete one", _resume("damaged-latest"),
     "(truncated?); {d}/damaged-latest/latest names global_step2, which is damaged: the complete checkpoint "
     "global_step1 is intact, load it with --load-tag global_step1"),
    ("export_hf: the tag latest names damaged beside a complete one",
     lambda d: ("pipeline.export_hf", ["--checkpoint", d / "damaged-latest", "--out", d / "x"]),
     "{d}/damaged-latest/latest names global_step2, which is damaged: the complete checkpoint global_step1 is "
     "intact, load it by passing {d}/damaged-latest/global_step1 in place of {d}/damaged-latest"),
    ("reshard --tag escaping its run", lambda d: ("pipeline.reshard", ["--checkpoint", d / "run", "--out", d / "r",
                                                                       "--tag", "../run/global_step1"]),
     "--tag tag '../run/global_step1', which is not a checkpoint directory inside {d}/run"),
    ("launch with no arguments", lambda d: ("pipeline.launch", []),
     "mds-launch: give the script to run and its arguments"),
]


def test_numbers_that_are_not_numbers(work):
    check_refusals(work, NUMBERS)


def test_files_that_are_not_what_they_claim(work):
    check_refusals(work, FILES)


def test_pretrain_save_refuses_what_the_user_owns(work, tmp_path):
    """``check_save_dir`` (pretrain calls it before anything is written): a data folder, an HF model's folder, an
    earlier run not resumed, an input inside --save; a new, empty or resumed run directory passes."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("text")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    refusals = [
        (data, {}, f"--save {data} holds corpus.txt, which a pretraining run does not write"),
        (hf, {}, f"--save {hf} holds a config.json, which a pretraining run does not write"),
        (work / "run", {}, f"--save {work}/run holds the checkpoints of another run (global_step1); continue "
                           f"that run with --save {work}/run and no --load"),
        (work / "run", {"load": work / "clf"}, "holds the checkpoints of another run"),
        (work / "link-latest", {"load": work / "link-latest"}, "latest is a link to"),
        (work / "run", {"inputs": [("--model-config", work / "run" / "config.json")], "load": None},
         "holds the checkpoints of another run"),
        (data / "corpus.txt", {}, "is a file, not a directory"),
    ]
    for save, kwargs, message in refusals:
        with pytest.raises(OutputError, match=None) as e:
            check_save_dir(save, **kwargs)
        assert message in str(e.value), str(e.value)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text((work / "run" / "config.json").read_text())  # a run killed before a save
    with pytest.raises(OutputError, match=f"--model-config {fresh}/config.json is inside --save {fresh}"):
        check_save_dir(fresh, inputs=[("--model-config", fresh / "config.json")])
    for save, kwargs in ((tmp_path / "new", {}), (fresh, {}), (work / "run", {"load": work / "run"}),
                         (work / "run", {"load": work / "run", "inputs": [("--model-config",
                                                                           work / "run" / "config.json")]})):
        check_save_dir(save, **kwargs)
