"""The engine's host-memory policy on CPU ranks: a freed large buffer stays in the process for reuse, unless the
user set glibc's allocator themselves (then nothing is changed).

Resident memory is asserted, not page faults: a kernel may fault pages that a process kept (NUMA balancing's
hinting faults, same-page merging), but it never counts memory that the process gave back as resident."""
from __future__ import annotations

import sys

from cli import cli_env, run_cli
from conftest import ROOT

# N float32 allocated, written and freed, and N allocated again at once (nothing allocated in between: a small
# block carved from the freed one would leave it too small); resident memory read before the first, after the
# second is allocated (the first's pages, kept or not) and after the second is written (what it added: nothing
# where it reuses the kept pages)
SCRIPT = """
import os, sys, torch
from pipeline.engine.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
n = int(sys.argv[1])
x = torch.empty(n)
x.fill_(1.0)
del x
y = torch.empty(n)
kept = resident() - before
y.fill_(2.0)
grown = resident() - before - kept
print(applied, kept, grown)
"""
MB = 1 << 20


def _run(n=50_000_000, **env):
    # the environment a command runs in: its start sets THP_MEM_ALLOC_ENABLE before torch (pipeline.job.errors)
    env = {"THP_MEM_ALLOC_ENABLE": "1", **env}
    applied, kept, grown = run_cli([sys.executable, "-c", SCRIPT, str(n)], ROOT, env=cli_env(**env)).stdout.split()
    return applied == "True", int(kept), int(grown)


def test_freed_large_buffers_are_kept_and_reused():
    applied, kept, grown = _run()
    assert applied
    assert kept > 190 * MB, kept / MB
    assert grown < 10 * MB, grown / MB  # the second buffer lives in the kept pages


def test_a_block_larger_than_any_trim_threshold_is_kept_too():
    # 2.4 GB: DeepSpeed's default fp32 gradient bucket is 2 GB; the largest threshold mallopt takes is 2 GiB
    applied, kept, grown = _run(600_000_000)
    assert applied
    assert kept > 2250 * MB, kept / MB  # of 2,289 MiB
    assert grown < 10 * MB, grown / MB


def test_a_users_own_allocator_setting_wins():
    applied, kept, grown = _run(MALLOC_MMAP_MAX_="65536")  # glibc's default, set by the user
    assert not applied
    assert kept < 20 * MB, kept / MB  # glibc gave the block back to the kernel
    assert grown > 190 * MB, grown / MB  # and faults the next one in afresh
