"""The tree is ruff-clean under the configuration in pyproject.toml (ruff is pinned in requirements.txt)."""
import subprocess
import sys

from conftest import ROOT


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_the_layers_hold():
    """import-linter's contracts of pyproject.toml (ARCHITECTURE.md's layers): each fails on one upward import."""
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "BROKEN" not in proc.stdout, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert proc.stdout.count("KEPT") >= 4, proc.stdout[-3000:]
