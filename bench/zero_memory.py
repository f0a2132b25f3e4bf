"""Memory per rank of ZeRO stages 0-3 at data-parallel size 2: what ZeRO partitions, expected against measured.

Two real gloo CPU ranks (torch.multiprocessing) train the same GPT through ``pipeline.engine.build.build_engine``
with the same bf16 DeepSpeed config, only ``zero_optimization.stage`` changing. On each rank the benchmark
measures:

  model states  the bytes of every tensor storage alive in the process (found through Python's garbage
                collector, plus each tensor's ``.grad``, each storage counted once however many views share it),
                less those alive before the engine was built. Taken after ``engine.backward`` (parameters,
                gradients, optimizer states, DeepSpeed's buffers; activations are freed by then) and after
                ``engine.step``; the larger is reported. Model states persist from step to step: each point
                counts what is alive there in every step after the first (the least of those steps), so that
                a transient held one step and not the next (seen once in ~50 censuses: ZeRO-2's 4 MiB
                embedding gradient still alive after one backward) is not taken for a state. This is the CPU
                counterpart of ``torch.cuda.memory_allocated`` (the GPU script reads that one directly).
  peak          the process's peak resident memory (``ru_maxrss``) less its resident memory before the engine
                was built: the peak within the steps, activations and transient buffers included. The ranks
                run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so that large freed tensors go back to
                the system and resident memory follows what is allocated.

Expected (ZeRO paper, mixed-precision Adam: 2 bytes of bf16 weights + 2 of bf16 gradients + 12 of fp32
master weights and Adam moments per parameter, Psi parameters, N_d = 2 ranks):
  stage 0: (2 + 2 + 12) Psi   stage 1: (2 + 2) Psi + 12 Psi / N_d
  stage 2: 2 Psi + (2 + 12) Psi / N_d   stage 3: (2 + 2 + 12) Psi / N_d
DeepSpeed's communication buckets are set to 1% of the model here so that they do not hide the partitioning
(the GPU configs use 5e8 elements; see --bucket). DeepSpeed 0.19.8's ZeRO-1 reduces the gradients bucket by
bucket during the backward and keeps only its own partition of them, as ZeRO-2 does: at DP=2 the two
measure the same, 1 byte of gradient per parameter rather than the paper's 2 for ZeRO-1.

    python bench/zero_memory.py [--variant gpt2] [--size medium] [--stages 0,1,2,3] [--seq 32] [--steps 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from common import CPU_SIZES, format_table  # noqa: E402

from models.parallel import initialize_model_parallel
from pipeline.engine.build import build_engine
from pipeline.engine.ds_config import resolve_ds_config

WORLD = 2
EXPECTED_BYTES_PER_PARAM = {  # (replicated, partitioned over N_d) bytes per parameter
    0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


def live_tensor_bytes() -> int:
    """Bytes of all tensor storages alive in this process (each storage once), gradients included."""
    gc.collect()
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = (st.device.type, st.data_ptr())
        if st.nbytes() and key not in seen:
            seen.add(key)
            total += st.nbytes()

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            add(obj.grad)  # .grad lives in C++ and is not always a Python object of its own
    return total


def ds_config(stage: int, bucket: int) -> dict:
    return {"train_batch_size": 2 * WORLD, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                  "stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": bucket, "stage3_max_reuse_distance": bucket},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def worker(rank: int, variant: str, size_name: str, stage: int, bucket: int, steps: int, seq: int) -> dict:
    common.quiet_deepspeed()
    state = initialize_model_parallel(1, 1)
    size = dict(CPU_SIZES[size_name])
    config = common.model_config(size, variant)
    tokens = torch.randint(0, config.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ds = resolve_ds_config(ds_config(stage, bucket), data_parallel=WORLD)
    rss_before = resident_bytes()
    base = live_tensor_bytes()
    engine = build_engine(config, ds, state, init_seed=1234)
    after = {"built": live_tensor_bytes() - base}
    steady = {"backward": [], "step": []}
    for _ in range(steps):  # the optimizer states exist from the first step on: count from the second
        loss = engine(x, y)
        engine.backward(loss)
        del loss
        after["backward"] = live_tensor_bytes() - base
        engine.step()
        after["step"] = live_tensor_bytes() - base
        for point in steady:
            steady[point].append(after[point])
    # what persists: at each point, the least over the steps after the first
    peak_states = max(after["built"], *(min(v[1:]) for v in steady.values()))
    return {"params": config.num_parameters(), "padded_params": sum(
        (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for p in engine.module.parameters()),
            "states": peak_states, **{f"after_{k}": v for k, v in after.items()},
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--size", default="medium", help=f"of {', '.join(CPU_SIZES)}")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--seq", type=int, default=32,
                   help="tokens per sequence (micro batch 2): short, so that activations do not hide the model states")
    p.add_argument("--steps", type=int, default=3,
                   help="at least 2: Adam's moments appear at the first step (3: what persists over two steps)")
    p.add_argument("--bucket", type=int, default=None,
                   help="DeepSpeed bucket sizes in elements (default: 1%% of the parameters)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(common.ROOT / "tests"))
    from dist import run_distributed  # the tests' launcher: N spawned gloo CPU ranks, results returned
    if args.steps < 2:
        p.error("--steps must be at least 2")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by the spawned ranks' C library at start

    config = common.model_config(CPU_SIZES[args.size], args.variant)
    bucket = args.bucket or max(10_000, config.num_parameters() // 100)
    print(f"# ZeRO memory per rank, DP={WORLD} gloo CPU ranks, {args.variant} {args.size} "
          f"({config.num_parameters() / 1e6:.1f}M parameters), bf16 + AdamW, micro batch 2 x {args.seq} tokens, "
          f"buckets {bucket:,} elements")
    rows, results = [], {}
    for stage in map(int, args.stages.split(",")):
        out = run_distributed(worker, WORLD, args.variant, args.size, stage, bucket, args.steps, args.seq)
        results[stage] = out
        psi = out[0]["padded_params"]
        rep, part = EXPECTED_BYTES_PER_PARAM[stage]
        expected = (rep + part / WORLD) * psi
        measured = max(r["states"] for r in out)
        rows.append([f"ZeRO-{stage}", f"{rep} + {part}/{WORLD}", expected / 2**20, measured / 2**20,
                     f"{measured / expected:.2f}", measured / psi,
                     max(r["peak"] for r in out) / 2**20])
    print(format_table(["stage", "bytes/param expected", "expected MiB", "measured MiB", "measured/expected",
                        "measured bytes/param", "peak MiB (RSS)"], rows))
    if 0 in results:
        s0 = max(r["states"] for r in results[0])
        print("\nreduction against ZeRO-0 (measured, expected): " + ", ".join(
            f"ZeRO-{s}: {max(r['states'] for r in results[s]) / s0:.2f}, "
            f"{(EXPECTED_BYTES_PER_PARAM[s][0] + EXPECTED_BYTES_PER_PARAM[s][1] / WORLD) / 16:.2f}"
            for s in results if s))
    return results


if __name__ == "__main__":
    main()
