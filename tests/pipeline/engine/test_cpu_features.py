"""A bf16 run on a CPU without bf16 instructions is said at start in one warning line; this CPU (avx512_bf16) and
fp32 runs are not warned about. The pretraining job reads the flags of a given cpuinfo file (an AVX2-only one)."""
import json
import sys
from pathlib import Path

from cli import run_cli
from run_utils import TINY_GPT2, ds_config, write_corpus, write_job_files

from pipeline.engine.cpu_features import bf16_cpu_warning, cpu_flags

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
WITH_BF16 = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_tile\n"


def test_the_warning_follows_the_flags_the_precision_and_the_device():
    assert cpu_flags(AVX2_ONLY) == {"fpu", "sse2", "avx", "avx2", "fma"}
    line = bf16_cpu_warning("bf16", "cpu", cpu_flags(AVX2_ONLY))
    assert line.startswith("warning: bf16 on a CPU without bf16 instructions") and "fp32" in line
    assert "\n" not in line
    assert bf16_cpu_warning("bf16", "cpu", cpu_flags(WITH_BF16)) is None
    assert bf16_cpu_warning("bf16", "cpu", cpu_flags("flags : avx2 amx_bf16")) is None
    assert bf16_cpu_warning("fp32", "cpu", cpu_flags(AVX2_ONLY)) is None
    assert bf16_cpu_warning("bf16", "cuda", cpu_flags(AVX2_ONLY)) is None
    assert bf16_cpu_warning("bf16", "cpu", cpu_flags("")) is None  # no flags known: no guess
    assert bf16_cpu_warning("bf16", "cpu", cpu_flags(Path("/proc/cpuinfo").read_text())) is None  # this CPU


# pipeline.pretrain as ``python -m`` runs it, reading ``cpuinfo`` in place of /proc/cpuinfo
PRETRAIN_WITH_CPUINFO = ("import pathlib, runpy, sys; import pipeline.engine.cpu_features as c; "
                         "c.CPUINFO = pathlib.Path(sys.argv.pop(1)); sys.argv[0] = 'pipeline.pretrain'; "
                         "runpy.run_module('pipeline.pretrain', run_name='__main__', alter_sys=True)")


def test_a_bf16_job_on_an_avx2_only_cpu_warns_once_at_start(tmp_path):
    bf16 = {**ds_config(stage=1, train_batch_size=2), "bf16": {"enabled": True}}
    write_job_files(tmp_path, TINY_GPT2, write_corpus(tmp_path).read_text(), ds=bf16)
    (tmp_path / "avx2.txt").write_text(AVX2_ONLY)
    job = ["--model-config", "model.json", "--deepspeed_config", "ds.json", "--data", "corpus.txt", "--tokenizer",
           "bytes", "--seq-length", "16", "--train-steps", "1"]
    warned = run_cli([sys.executable, "-c", PRETRAIN_WITH_CPUINFO, tmp_path / "avx2.txt", *job], tmp_path)
    lines = [ln for ln in warned.stderr.splitlines() if "bf16 instructions" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: "), warned.stderr[-2000:]
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(stage=1, train_batch_size=2)))  # fp32: no warning
    quiet = run_cli([sys.executable, "-c", PRETRAIN_WITH_CPUINFO, tmp_path / "avx2.txt", *job], tmp_path)
    assert "bf16 instructions" not in quiet.stderr
