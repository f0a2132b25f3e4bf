"""The tree is ruff-clean under the configuration in pyproject.toml (ruff is pinned in requirements.txt)."""
import subprocess
import sys

from conftest import ROOT


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
