"""The top-level error handler (one line, exit 2, rank 0 only, --debug shows the traceback) and atomic writes."""
import json
import os
import subprocess
import sys

import pytest

from finetune.data import DataFormatError
from finetune.job.args import FinetuneError
from models.config import ConfigError
from pipeline.checkpoints.checkpoint import CheckpointError
from pipeline.engine.ds_config import EngineConfigError
from pipeline.job.errors import InputError, UserError, command, format_user_error
from pipeline.job.files import atomic_dir, atomic_path, atomic_write_json, atomic_write_text
from conftest import ROOT



@command
def _job(argv=None):
    if argv and argv[0] == "bug":
        raise KeyError("a bug keeps its traceback")
    if argv and argv[0] == "missing":
        open(argv[1])  # the OS's own FileNotFoundError
    raise InputError("data.tsv: line 3, field 'joy': label must be 0 or 1, found '2';\n fix the line")


def test_a_user_error_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        _job(["x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: data.tsv: line 3, field 'joy': label must be 0 or 1, found '2'; fix the line\n"


def test_an_os_error_names_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _job(["missing", str(tmp_path / "nope.txt")])
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.txt'}: no such file or directory; check the path\n"


def test_a_bug_is_not_a_user_error():
    with pytest.raises(KeyError):
        _job(["bug"])


def test_only_rank_0_reports(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        _job(["x"])
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_DEBUG", "1")
    with pytest.raises(SystemExit) as e:
        _job(["x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("error: data.tsv")


def test_project_error_classes_are_user_errors():
    assert all(issubclass(c, UserError) for c in (DataFormatError, FinetuneError, CheckpointError, EngineConfigError))
    assert format_user_error(ConfigError("gpt2-tiny.json: field 'num_heads' must be >= 1; fix it")) == \
        "error: gpt2-tiny.json: field 'num_heads' must be >= 1; fix it"


def test_a_command_reports_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.evaluate", "--task", "bpc", "--data",
                           str(tmp_path / "missing.txt"), "--checkpoint", str(tmp_path), "--out",
                           str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: text file {tmp_path / 'missing.txt'} does not exist"]


# ------------------------------------------------------------------------------------------- atomic writes

def test_atomic_file_writes_leave_no_temporary_and_keep_the_old_file_on_failure(tmp_path):
    target = tmp_path / "sub" / "out.json"
    atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"a": 1}
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n" and sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_atomic_dir_is_all_or_nothing(tmp_path):
    out = tmp_path / "export"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    with pytest.raises(FileExistsError, match="is not empty; choose another one or pass --force"):
        with atomic_dir(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_dir(out, force=True) as tmp:
            (tmp / "b.txt").write_text("2")
            raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]
    with atomic_dir(out, force=True) as tmp:  # --force replaces an earlier output of the same kind
        (tmp / "a.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"] and (out / "a.txt").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
