"""Run a function on N local CPU ranks over gloo, as the tests' multi-process launcher.

``run_distributed(fn, world_size, ...)`` spawns the ranks, each joins a real
gloo process group, runs ``fn(rank, *args)``, and the per-rank return values come
back to the test process (through torch.save files, so tensors travel whole).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pipeline.engine.distributed import free_port


def _worker(rank, world_size, port, out_dir, fn, args, env):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pipeline.engine.distributed import init_distributed
    init_distributed("gloo")
    result = fn(rank, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn, world_size: int | None = None, *args, tp: int = 1, pp: int = 1, dp: int = 1,
                    env: dict | None = None):
    """``fn(rank, *args)`` on ``world_size`` ranks, or on tp x pp x dp ranks when it is not given:
    ``run_distributed(fn, 2, a, b)`` or ``run_distributed(fn, tp=2, dp=2)``."""
    world_size = world_size or tp * pp * dp
    with tempfile.TemporaryDirectory() as out:
        for attempt in range(3):
            try:
                mp.start_processes(_worker, args=(world_size, free_port(), out, fn, args, env or {}),
                                   nprocs=world_size, join=True, start_method="spawn")
                break
            except mp.ProcessRaisedException as e:
                # the free port was taken before rank 0 listened on it (the other xdist worker's launches pick
                # ports too): nothing of ``fn`` ran, the ranks stopped in init_distributed; a new port
                if "EADDRINUSE" not in str(e) or attempt == 2:
                    raise
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
