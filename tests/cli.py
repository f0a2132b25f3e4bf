"""The one way the tests run a command in a subprocess: offline, one OpenMP thread, this checkout first on the
path, the venv's scripts (``deepspeed``, ``torchrun``) on PATH, and the output tails in the failure message."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def cli_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FORCE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.update(extra)
    return env


def run_cli(cmd, cwd, *, timeout: float = 600, check: bool = True, env: dict | None = None):
    """``subprocess.run`` of ``cmd`` (a list; ``python -m X`` as ``[sys.executable, "-m", X, ...]``), text output
    captured; ``check``: the exit code must be 0, else the test fails with the command and its output."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or cli_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"{' '.join(map(str, cmd))}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                                      f"{proc.stderr[-5000:]}")
    return proc
