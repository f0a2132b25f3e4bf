"""The engine's host-memory policy on CPU ranks: a freed large buffer is reused without page faults, unless the
user set glibc's allocator themselves (then nothing is changed)."""
from __future__ import annotations

import sys

from cli import cli_env, run_cli
from conftest import ROOT

# 200 MB allocated, written and freed twice; the page faults of the second time are counted
SCRIPT = """
import resource, torch
from pipeline.engine.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
def touch():
    x = torch.empty(50_000_000)
    x.fill_(1.0)
    del x
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(**env):
    out = run_cli([sys.executable, "-c", SCRIPT], ROOT, env=cli_env(**env)).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_large_buffers_are_reused_without_page_faults():
    applied, faults = _faults()
    assert applied
    assert faults < 20, faults  # 200 MB is at least 95 faults of 2 MB pages, 48,800 of 4 KB pages


def test_a_users_own_allocator_setting_wins():
    applied, faults = _faults(MALLOC_MMAP_MAX_="65536")  # glibc's default, set by the user
    assert not applied
    assert faults >= 95, faults  # glibc gave the block back: it is faulted in again
