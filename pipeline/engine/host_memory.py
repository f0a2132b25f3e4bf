"""Training on CPU ranks: keep freed host memory in the process, as a GPU caching allocator keeps device memory.

DeepSpeed's ZeRO-1/2 optimizer allocates its gradient bucket and its gradient partition afresh in every backward
and frees them after the step. glibc hands blocks that large to the kernel on free (mmap above 32 MiB, and trims
the heap's top), so each step faults every page of them in again and the kernel zeroes them: measured on this
project's llama medium (38.5M parameters, fp32, one rank), a copy into a fresh 154 MB buffer took 77 ms against
22 ms into a reused one, about 7,600 page faults per step, and ZeRO-1 ran at 0.94 of a plain PyTorch loop.
With freed blocks kept (no mmap for large blocks, the heap's top trimmed only above 2 GiB) the same step makes
0-200 faults and runs at 0.96. The process's resident memory then stays at its peak, as on a GPU.

A user's own glibc allocator settings win (any ``MALLOC_*`` variable or ``GLIBC_TUNABLES``), and so does another
allocator preloaded in place of glibc's (jemalloc, tcmalloc: glibc's ``mallopt`` then changes nothing they use).
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set

_applied = False


def user_set_allocator() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep freed large blocks for reuse (once per process). True when it is in effect."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_set_allocator():
        return False
    libc = ctypes.CDLL("libc.so.6")
    _applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX))
    return _applied
