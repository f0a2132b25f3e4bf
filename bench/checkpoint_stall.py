"""The training stall per checkpoint: the asynchronous save (``pretrain --async-save``) against the synchronous save
of the same state.

    python bench/checkpoint_stall.py [--rounds 4] [--steps 2] [--dir DIR]

A GPT of about 100M parameters (hidden 768, 12 layers, vocabulary 16384: 98M), fp32, AdamW, ZeRO-1, one process
on the CPU: the DeepSpeed engine of ``pipeline.engine.build.build_engine``, saved by the savers ``pipeline.pretrain``
uses (``pipeline.checkpoints.async_save``: ``SyncSaver`` is ``--save`` as before, ``AsyncSaver`` is
``--async-save``), into ``--dir`` (default: a temporary directory; the disk's page cache and fsync decide the
write time). Each round, in turn (the order rotating): a synchronous save (the loop is blocked for all of it),
``--steps`` steps, an asynchronous save followed by steps with its poll at each boundary until its write has
ended (the stall: the time in ``save`` plus the time in the polls), ``--steps`` steps. Prints, per save kind, the
median blocked time, the write's wall time, and the step time with and without a write in flight (the cost of
sharing the CPU with the writer thread), with the machine's load average: a shared CPU makes these noisy. A first
save of each kind comes before the rounds, reported apart (the asynchronous saver allocates its host buffers then).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import torch  # noqa: E402

from models import GPTConfig  # noqa: E402
from models.parallel import get_parallel_state, initialize_model_parallel  # noqa: E402
from pipeline.checkpoints.async_save import AsyncSaver, SyncSaver  # noqa: E402
from pipeline.engine.build import build_engine  # noqa: E402
from pipeline.engine.distributed import init_distributed  # noqa: E402
from pipeline.engine.ds_config import resolve_ds_config  # noqa: E402
from pipeline.engine.steps import train_step  # noqa: E402

DS = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}


def build(args):
    config = GPTConfig(variant="gpt2", hidden_size=args.hidden, num_layers=args.layers, num_heads=12,
                       vocab_size=args.vocab, max_position_embeddings=args.seq, hidden_dropout=0.0,
                       attention_dropout=0.0)
    ds = resolve_ds_config(DS, data_parallel=1, micro_batch_size=1, global_batch_size=1)
    engine = build_engine(config, ds, get_parallel_state(), init_seed=1)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def batches():
        while True:
            yield batch
    it = batches()
    return engine, lambda: train_step(engine, it)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Round:
    """The step counter and the tags written, shared by both savers (each its own directory)."""

    def __init__(self, step_fn):
        self.step_fn, self.step = step_fn, 0
        self.idle_steps, self.overlapped_steps = [], []

    def steps(self, n: int, saver=None) -> float:
        """``n`` steps (``saver``: its poll after each, as the loop's hook, until its write has ended); returns the
        time spent in the polls."""
        polled = 0.0
        for _ in range(n):
            self.step += 1
            in_flight = saver is not None and saver.write is not None
            (self.overlapped_steps if in_flight else self.idle_steps).append(timed(self.step_fn))
            if in_flight:
                polled += timed(lambda: saver.poll(None))
        return polled


def async_round(r: Round, saver: AsyncSaver, steps: int) -> tuple[float, float]:
    """(blocked seconds, write wall seconds) of one asynchronous save, the steps going on until its write ends."""
    start = time.perf_counter()
    blocked = timed(lambda: saver.save(r.step, None))
    while saver.write is not None:
        blocked += r.steps(1, saver)
    return blocked, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="steps between saves")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dir", default=None, help="where the tags go (default: a temporary directory)")
    args = p.parse_args(argv)
    common.quiet_deepspeed()
    init_distributed()
    initialize_model_parallel(1, 1)
    engine, step_fn = build(args)
    params = sum(p.numel() for p in engine.module.parameters())
    layout = {**get_parallel_state().layout.record(), "model_type": "gpt2"}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sync, asynchronous = SyncSaver(engine, Path(tmp) / "sync", layout), AsyncSaver(engine, Path(tmp) / "async",
                                                                                        layout)
        r = Round(step_fn)
        r.steps(2)  # the optimizer's state exists
        first = (timed(lambda: sync.save(r.step, None)), async_round(r, asynchronous, args.steps)[0])
        r.idle_steps, r.overlapped_steps = [], []
        sync_s, stall_s, write_s = [], [], []
        for i in range(args.rounds):
            for kind in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
                if kind == "sync":
                    sync_s.append(timed(lambda: sync.save(r.step, None)))
                else:
                    blocked, wall = async_round(r, asynchronous, args.steps)
                    stall_s.append(blocked)
                    write_s.append(wall)
                r.steps(args.steps)
                for run in (Path(tmp) / "sync", Path(tmp) / "async"):  # one tag at a time on the disk
                    for old in sorted(run.glob("global_step*"))[:-1]:
                        shutil.rmtree(old)
        tag_bytes = sum(f.stat().st_size for f in (Path(tmp) / "sync").rglob("*") if f.is_file())
        asynchronous.__exit__(None, None, None)
    report(args, params, tag_bytes, sync_s, stall_s, write_s, r, first)


def report(args, params, tag_bytes, sync_s, stall_s, write_s, r: Round, first):
    med = statistics.median
    print(f"# checkpoint stall, GPT {params / 1e6:.0f}M parameters, fp32 ZeRO-1 AdamW, one process: "
          f"{common.machine_note()}; {os.cpu_count()} cores of {cpu_name()}; {args.rounds} rounds, medians")
    print(f"# a tag: {tag_bytes / 1e9:.2f} GB (the run's files beside it not counted)")
    print("| save | training blocked per save (s) | of the synchronous save | write's wall time (s) |")
    print("| --- | --- | --- | --- |")
    print(f"| synchronous (--save) | {med(sync_s):.2f} | 100% | {med(sync_s):.2f} |")
    print(f"| asynchronous (--async-save) | {med(stall_s):.2f} | {100 * med(stall_s) / med(sync_s):.1f}% | "
          f"{med(write_s):.2f} |")
    print(f"# step time: {med(r.idle_steps):.2f} s with no write in flight, "
          f"{med(r.overlapped_steps) if r.overlapped_steps else float('nan'):.2f} s while a write runs beside it "
          f"({len(r.overlapped_steps)} steps)")
    print(f"# every value: sync {[round(x, 2) for x in sync_s]}, async stall {[round(x, 2) for x in stall_s]}; "
          f"the first save of each (not counted: the async one allocates its host buffers): sync {first[0]:.2f}, "
          f"async stall {first[1]:.2f}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "an unknown CPU"


if __name__ == "__main__":
    main()
