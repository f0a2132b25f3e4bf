"""The finetuning job's run directory, through the command line (docs/runs.md), and a model imported without a
tokenizer continued with an explicit --tokenizer, all in one Python start (tests/forked_cli.py).

The base is such a model (config.json + model.safetensors, 300 embedding rows, no tokenizer files): finetuned with
--tokenizer bytes (258 tokens), killed saving its state at step 3, then the same command resumes from step 2 (one
metrics.jsonl series, args.json / ds_config.json saved, the summary and next commands at the end); the same
command again has nothing to run; another --lr is refused naming it; --no-resume refuses the directory; a run
without --save warns. pretrain --load of the same base takes --tokenizer bytes (the unused rows said) and refuses
the GPT-2 tokenizer (50257 tokens) with what to pass, as finetune does; a --load of that run names what changed."""
import json
import re
from pathlib import Path

import pytest
from cli import cli_env
from conftest import shared_data
from forked_cli import run_forked
from run_utils import ds_config, write_corpus

from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel
from pipeline.checkpoints.model_dir import write_model_dir

BASE = dict(variant="gpt2", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32,
            make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ft_runs")
    initialize_model_parallel(1)
    config = GPTConfig(**BASE)
    full = full_state_dict(GPT(config, init_seed=5))
    destroy_model_parallel()
    base = write_model_dir(config, full, d / "base")  # what pipeline.import_hf writes for a model without tokenizer
    lines = (shared_data("semeval2018-ec") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:21]
    (d / "ec.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (d / "ds.json").write_text(json.dumps(ds_config(stage=1, train_batch_size=4, lr=1e-3)))
    write_corpus(d)
    gpt2 = shared_data("tokenizers", "gpt2")

    def finetune(save, *extra):
        return ("finetune.train", ["--base", base, "--tokenizer", "bytes", "--train", d / "ec.tsv", "--dev",
                                   d / "ec.tsv", "--train-steps", "4", "--eval-interval", "100000", "--log-interval",
                                   "1", "--max-length", "16", "--global-batch-size", "4", "--deepspeed_config",
                                   d / "ds.json", "--hf-export", "no", *(["--save", save] if save else []), *extra])

    pretrain = ["--load", base, "--deepspeed_config", d / "ds.json", "--data", d / "corpus.txt", "--seq-length", "16",
                "--train-steps", "1", "--cache-dir", d / "cache"]
    clf = d / "clf"
    cases = [
        finetune(clf, "--save-interval", "1"),  # killed saving step 3 (PIPELINE_CRASH_AT)
        finetune(clf),  # the same command: resumes from step 2
        finetune(clf),  # and again: nothing to run
        finetune(clf, "--lr", "1e-4"),
        finetune(clf, "--no-resume"),
        finetune(None, "--train-steps", "1"),
        ("pipeline.pretrain", [*pretrain, "--tokenizer", "bytes", "--save", d / "continued"]),
        ("pipeline.pretrain", [*pretrain, "--tokenizer", gpt2]),
        ("finetune.train", [*finetune(None)[1], "--tokenizer", gpt2]),
        ("pipeline.pretrain", [*pretrain[2:], "--load", d / "continued", "--save", d / "other", "--tokenizer", "bytes",
                               "--lr", "2e-3"]),
    ]
    return d, run_forked(cases, d, env=cli_env(PIPELINE_CRASH_AT="after-deepspeed-files:3"))


def test_the_same_finetune_command_resumes_then_has_nothing_to_run(runs):
    d, results = runs
    clf = d / "clf"
    (killed, _, _), (code, out, err) = results[0], results[1]
    assert killed == -9
    assert code == 0, err[-3000:]
    assert f"note: continuing the interrupted run in {clf} after step 2, from its last complete checkpoint " \
           f"{clf}/checkpoint/global_step2" in err
    logged = [r for r in records(clf) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]  # the killed run's step 3 dropped, logged again
    assert sum("settings" in r for r in records(clf)) == 1
    final = records(clf)[-2]  # then the "saved" record
    assert final["step"] == 4 and 0 < final["dev_loss"] < 2, final  # BCE of 11 labels: ~0.69 at chance
    summary = re.escape(f"done: steps 3-4, train loss {logged[-1]['loss']:.4f}, dev loss {final['dev_loss']:.4f}, "
                        f"dev micro-F1 {final['dev_tuned_micro_f1']:.4f}, macro-F1 {final['dev_tuned_macro_f1']:.4f}, "
                        f"Jaccard {final['dev_tuned_jaccard']:.4f} (tuned thresholds), classifier {clf}")
    assert len(re.findall("^" + summary + "$", out, flags=re.M)) == 1, out[-2000:]
    assert f"  python -m finetune.predict --model {clf} --data {d / 'ec.tsv'} --out {clf}-predictions.txt" in out
    assert f"  python -m finetune.export_hf --model {clf} --out {clf}-hf --verify" in out
    args, ds = (json.loads((clf / name).read_text()) for name in ("args.json", "ds_config.json"))
    assert (args["train_steps"], args["max_length"], args["save_interval"]) == (4, 16, None)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (4, 4)
    assert not (clf / "checkpoint").exists() and (clf / "classifier.json").is_file()

    code, out, err = results[2]
    assert code == 0, err[-2000:]
    assert f"{clf} holds the classifier this command finished at step 4: nothing to run" in out
    assert re.search("^" + re.escape("done: no steps to run (at step 4), train loss ") + ".*" +
                     re.escape(f"(tuned thresholds), classifier {clf}") + "$", out, flags=re.M), out
    assert [r["step"] for r in records(clf) if "loss" in r] == [1, 2, 3, 4]  # nothing appended


def test_other_settings_no_resume_and_no_save_are_said_in_one_line(runs):
    d, results = runs
    clf = d / "clf"
    code, _, err = results[3]
    assert code == 2 and error_lines(err) == [
        f"error: --save {clf} holds a classifier trained with other settings (--lr 5e-05 -> 0.0001); choose a new "
        f"directory, or pass --force to replace it"], err[-2000:]
    code, _, err = results[4]
    assert code == 2 and len(error_lines(err)) == 1, err[-2000:]
    assert error_lines(err)[0].startswith(f"error: --save {clf} holds args.json, classifier.json, ")
    assert "--no-resume starts a new run in a new or empty directory only" in err
    code, out, err = results[5]
    assert code == 0, err[-2000:]
    assert "warning: no --save: this run keeps nothing (no classifier, no metrics.jsonl)" in out
    assert re.search(r"^done: steps 1-1, train loss [\d.]+, dev loss [\d.]+, .*no classifier saved \(no --save\)$",
                     out, flags=re.M), out[-2000:]


def test_a_model_without_tokenizer_takes_one_that_fits(runs):
    d, results = runs
    base = d / "base"
    unused = f"note: --tokenizer bytes has 258 tokens for the 300 embedding rows of {base}: rows 258-299 are unused"
    assert unused in results[1][1]  # finetune
    code, out, err = results[6]  # pretrain
    assert code == 0, err[-3000:]
    assert unused in out
    assert json.loads((d / "continued" / "config.json").read_text())["vocab_size"] == 300
    assert (d / "continued" / "tokenizer" / "tokenizer.json").is_file()
    code, _, err = results[7]
    assert code == 2 and len(error_lines(err)) == 1, err[-3000:]
    assert "50257 tokens, but the model in" in error_lines(err)[0] and "of at most 300 tokens" in err
    code, _, err = results[8]
    assert code == 2 and len(error_lines(err)) == 1, err[-3000:]
    assert "50257 tokens, but the model in" in error_lines(err)[0] and "(300 tokens at most)" in err


def test_a_load_run_names_its_changed_settings_and_saves_nothing_past_its_end(runs):
    """--load of the continued run (at step 1) into another --save, --train-steps 1: nothing to run, said so, and
    the one setting that differs named (not --save, which differs by design)."""
    d, results = runs
    code, out, err = results[9]
    assert code == 0, err[-3000:]
    assert f"settings changed since {d / 'continued' / 'args.json'}: --lr (unset) -> 0.002\n" in out
    assert f"done: no steps to run (at step 1), no checkpoint in {d / 'other'}" in out
