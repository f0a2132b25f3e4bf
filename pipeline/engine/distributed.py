"""Process-group start-up for every entry point (deepspeed launcher, torchrun, or one plain process)."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket

import torch
import deepspeed
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import deepspeed.ops
from deepspeed.accelerator import get_accelerator


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_world_size() -> int:
    """The world size the launcher gave (its WORLD_SIZE), or the process group's once it is joined; 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str | None = None, *, timeout_minutes: float | None = None) -> None:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    A plain ``python -m ...`` run has none of these: it becomes a one-rank group on
    loopback, so the same code path (DeepSpeed engine, groups) runs everywhere.
    ``timeout_minutes``: how long a collective waits for a dead or stuck rank before it fails (torch's
    default, 10 minutes for NCCL and 30 for gloo, when None).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        skip_shared_memory_all_reduce()
    timeout = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    deepspeed.init_distributed(dist_backend=backend or default_backend(), verbose=False, **timeout)
    atexit.unregister(_leave_process_group)  # once, however many times a process joins a group
    atexit.register(_leave_process_group)
    if timeout:
        _new_groups_wait_as_long(timeout["timeout"])


def _leave_process_group() -> None:
    """At exit, leave the group as torch asks: a process that exits with it open tears gloo's threads down
    unjoined, and a rank could abort there ("terminate called without an active exception", SIGABRT) after
    its work was done, failing its launcher's job."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _new_groups_wait_as_long(timeout: datetime.timedelta) -> None:
    """Every group made after the world group (the mpu's, DeepSpeed's ZeRO, expert and pipeline groups) gets the
    world group's timeout: ``dist.new_group`` without ``timeout=`` takes torch's default (30 min for gloo), not the
    world group's, so a rank stuck in, say, ZeRO's gradient-norm all-reduce over the data-parallel group would
    hold the others that long. torch reads these module defaults at each ``new_group``."""
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def skip_shared_memory_all_reduce() -> None:
    """DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce (for its inference engine) at
    every start, and leaves a /dev/shm buffer of each run behind, until the host's memory is full.
    Training never calls it: mark the op unavailable so it is neither built nor allocated."""
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
