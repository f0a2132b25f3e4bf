"""GPU training-step benchmark, one H200 (or any CUDA GPU): the GPT at ~350M, ~1.3B and ~2.7B parameters through the
DeepSpeed engine beside Hugging Face's model in the same conditions; tokens/s, TFLOP/s and MFU against the
measured matmul peak. Runs in under 8 minutes; installs nothing.

Systems, per (size, precision), the same shapes, batch, sequence, optimizer (torch's fused AdamW, gradient
clipping 1.0) and precision:
  deepspeed  the project's GPT through ``pipeline.engine.build.build_engine`` with ds_configs/bf16_zero1.json
             (bf16 weights and activations, fp32 master weights, ZeRO-1) or ds_configs/fp16_zero1.json (fp16
             with dynamic loss scaling; fp16 needs ZeRO >= 1 here), one rank (NCCL);
  hf         GPT2LMHeadModel (SDPA attention) in a plain loop: fp32 weights with torch.autocast (bf16, or fp16
             with torch's GradScaler), the same AdamW;
  plain      (--systems ...,plain) the project's GPT in that plain loop: the engine's overhead;
  +compile   a suffix: each transformer block compiled (``--compile``, models/compile.py);
  +fp8       a suffix: the column- and row-parallel linears in FP8, torchao's tensorwise recipe (``--fp8``;
             ``+fp8-rowwise`` the rowwise one), over the same bf16 weights and fp32 masters.
The default run is bf16 at 1.3B and 2.7B: deepspeed, deepspeed+compile, deepspeed+fp8, deepspeed+compile+fp8, hf.
FP8's loss against bf16 after 200 steps (the same repeated batch): ``--sizes 1.3b --systems deepspeed,deepspeed+fp8
--steps 200 --warmup 0``, the rows' last losses.
Dropout 0 everywhere. On a GPU each system is built, warmed up and timed in turn (two 1.3B models with their
optimizer states and activations would not both fit); the device is not shared, so timings are steady.
MFU = GPTConfig.flops_per_token (PaLM's count) x tokens/s over the bf16 (fp16) matmul rate measured first
(8192^3 products), and also over the datasheet's dense peak (989 TFLOP/s for H100/H200 SXM bf16).

Run on the device machine (from the repository root; DeepSpeed and the few packages it needs that the
image lacks travel as wheels, built or fetched here once):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
    # device tool: run(carry=[".whl"], timeout_s=540, command=
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_h200.py --out $OUT

(DeepSpeed publishes a source archive only; ``pip wheel`` makes its pure-Python wheel, py3-none-any, with no
compiled ops: the benchmark uses torch's fused AdamW, so no DeepSpeed op is built on the GPU machine.)

Tested on a CPU with tiny models: ``python bench/gpu_h200.py --cpu-smoke`` (the same code path, fp16 too).

    python bench/gpu_h200.py [--sizes 1.3b,2.7b] [--precisions bf16] [--steps 30] [--warmup 3]
                             [--systems deepspeed,deepspeed+compile,deepspeed+fp8,deepspeed+compile+fp8,hf] [--variants gpt2,llama] [--recompute none,selective,full]
                             [--profile STEPS] [--budget-s 360] [--out DIR] [--cpu-smoke]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from common import GPU_SIZES, ROOT, TINY_SIZES, format_table  # noqa: E402
from train_step import make_system  # noqa: E402

from models.parallel import initialize_model_parallel
from pipeline.engine.distributed import init_distributed

DS_CONFIGS = {"bf16": ROOT / "ds_configs" / "bf16_zero1.json", "fp16": ROOT / "ds_configs" / "fp16_zero1.json"}
DATASHEET_TFLOPS = {"bf16": 989.0, "fp16": 989.0}  # H100/H200 SXM dense


def measure(system, steps: int, warmup: int, device) -> dict:
    for _ in range(warmup):
        system.step()
    common.sync(device)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(system.step())
        common.sync(device)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "times": times, "first_loss": losses[0], "last_loss": losses[-1]}


KERNEL_KINDS = (  # (kind, name fragments), first match wins; names of CUDA kernels, or of aten ops on a CPU
    ("attention", ("flash", "fmha", "attention", "efficient", "cudnn_sdpa", "scaled_dot")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                "scaled_mm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "copy_", "aten::to", "fill_")),
    ("cross-entropy", ("softmax", "nll", "cross_entropy", "log_softmax")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, frags in KERNEL_KINDS if any(f in low for f in frags)), "element-wise/other")


def profile_steps(system, steps: int, device) -> dict:
    """Where a step's device time goes: kernel time by kind (matmul, attention, element-wise, optimizer, ...)
    over ``steps`` profiled steps, and the busy fraction (kernel time / wall time: the rest is the device idle,
    waiting for the host). On a CPU the same over the aten ops' own CPU time (a smoke check of the code)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    common.sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            system.step()
        common.sync(device)
        wall = time.perf_counter() - t0
    if cuda:
        averages = prof.key_averages()
        # a record_function range (e.g. "Optimizer.step#AdamW.step") shows on the GPU timeline too, over the
        # kernels it launched: only what no host-side event is named after is a kernel
        host = {e.key for e in averages if e.device_type == DeviceType.CPU}
        events = [(e.key, e.self_device_time_total) for e in averages
                  if e.device_type == DeviceType.CUDA and e.key not in host]
    else:
        events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    by_kind, top = {}, sorted(events, key=lambda kv: -kv[1])[:12]
    for name, us in events:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + us / 1e6 / steps
    busy = sum(by_kind.values())
    return {"step_wall_s": wall / steps, "busy_s": busy, "busy_fraction": busy * steps / wall,
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [(name[:90], us / 1e6 / steps) for name, us in top]}


def run(args) -> list[dict]:
    device = "cpu" if args.cpu_smoke else "cuda"
    sizes = TINY_SIZES if args.cpu_smoke else GPU_SIZES
    t_start = time.perf_counter()
    peaks = {p: common.matmul_peak(common.DTYPES[p], device, n=512 if args.cpu_smoke else 8192, seconds=0.1
                                   if args.cpu_smoke else 1.0) for p in args.precisions}
    print("# measured matmul peak: " + ", ".join(f"{p} {v / 1e12:.1f} TFLOP/s" for p, v in peaks.items()), flush=True)
    rows, skipped = [], []
    for variant, size_name in [(v, s) for v in args.variants for s in args.sizes]:
        size = sizes[size_name]
        config = common.model_config(size, variant)
        tokens = torch.randint(0, config.vocab_size, (size["batch"], size["seq"] + 1),
                               generator=torch.Generator().manual_seed(0))
        step_flops = config.flops_per_token(size["seq"]) * size["batch"] * size["seq"]
        for precision in args.precisions:
            base_ds = json.loads(DS_CONFIGS[precision].read_text())
            for name, recompute in [(n, r) for n in args.systems
                                    for r in (args.recompute if n.startswith("deepspeed") else ["none"])]:
                label = " ".join([variant, size_name, precision, name] + ([] if recompute == "none" else [recompute]))
                if time.perf_counter() - t_start > args.budget_s:
                    skipped.append(label)
                    continue
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                system = None
                try:
                    system = make_system(name, config, tokens, precision, base_ds, device=device, recompute=recompute)
                    built_s = time.perf_counter() - t0
                    m = measure(system, args.steps, args.warmup, device)
                    if args.profile:
                        m["profile"] = prof = profile_steps(system, args.profile, device)
                        print(f"{label} profile: busy {100 * prof['busy_fraction']:.0f}% of {prof['step_wall_s']:.4f} s; "
                              + ", ".join(f"{k} {v:.4f} s" for k, v in prof["by_kind_s"].items()), flush=True)
                        for kernel, sec in prof["top"]:
                            print(f"    {sec:.5f} s  {kernel}", flush=True)
                except torch.OutOfMemoryError as e:  # report it and go on with the other systems
                    print(f"{label}: out of memory ({str(e).splitlines()[0]})", flush=True)
                    skipped.append(f"{label} (out of memory)")
                    if system is not None:
                        common.release(system)
                    system = None
                    gc.collect()
                    continue
                tflops = step_flops / m["step_s"] / 1e12
                row = {"variant": variant, "size": size_name, "params": config.num_parameters(),
                       "precision": precision, "system": name, "recompute": recompute,
                       "batch": size["batch"], "seq": size["seq"], "tokens_per_s": size["batch"] * size["seq"] / m["step_s"],
                       "tflops": tflops, "mfu_measured_peak": tflops * 1e12 / peaks[precision],
                       "mfu_datasheet": tflops / DATASHEET_TFLOPS[precision], "build_s": built_s,
                       "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                       **m}
                if name.startswith("deepspeed"):
                    from pipeline.engine.steps import loss_scale
                    row["loss_scale"] = loss_scale(system.owner)
                    row["skipped_steps"] = int(system.owner.skipped_steps)
                rows.append(row)
                print(f"{label}: {row['tokens_per_s']:,.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU "
                      f"{100 * row['mfu_measured_peak']:.1f}% (loss {m['first_loss']:.3f} -> {m['last_loss']:.3f}, "
                      f"built in {built_s:.0f} s)", flush=True)
                common.release(system)  # a DeepSpeed engine holds its memory until destroy()
                system = None
                gc.collect()
    for r in rows:
        hf = next((h for h in rows if h["system"] == "hf" and h["size"] == r["size"]
                   and h["precision"] == r["precision"] and h["variant"] == r["variant"]), None)
        r["vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"] if hf else None
    print(f"\n# {common.machine_note(device)}; {args.warmup} warm-up + {args.steps} timed steps per system; "
          f"medians; total {time.perf_counter() - t_start:.0f} s")
    print(format_table(
        ["model", "size", "precision", "system", "recompute", "batch x seq", "tokens/s", "x HF", "TFLOP/s", "MFU (measured peak)",
         "MFU (datasheet)", "max memory GiB", "loss scale"],
        [[r["variant"], f"{r['size']} ({r['params'] / 1e6:.3g}M)", r["precision"], r["system"], r["recompute"],
          f"{r['batch']} x {r['seq']}",
          r["tokens_per_s"], "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}", r["tflops"],
          f"{100 * r['mfu_measured_peak']:.1f}%", f"{100 * r['mfu_datasheet']:.1f}%",
          "-" if r["max_memory_gib"] is None else f"{r['max_memory_gib']:.1f}",
          f"{r['loss_scale']:g}" if "loss_scale" in r else "-"] for r in rows]))
    if skipped:
        print(f"not measured (time budget {args.budget_s:.0f} s, or memory): {', '.join(skipped)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / "gpu_bench.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"peaks_tflops": {p: v / 1e12 for p, v in peaks.items()}, "rows": rows,
                                   "skipped": skipped, "machine": common.machine_note(device)}, indent=1))
        tmp.replace(out)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help=f"of {', '.join(GPU_SIZES)} (--cpu-smoke: {', '.join(TINY_SIZES)})")
    p.add_argument("--precisions", default="bf16", help="bf16, fp16 (comma list)")
    p.add_argument("--systems", default="deepspeed,deepspeed+compile,deepspeed+fp8,deepspeed+compile+fp8,hf",
                   help="deepspeed, deepspeed-zN, hf, plain; +compile, +fp8, +fp8-rowwise suffixes (comma list)")
    p.add_argument("--variants", default="gpt2", help="model families: gpt2, llama (grouped-query, untied)")
    p.add_argument("--recompute", default="none",
                   help="activation recomputation policies for the DeepSpeed systems: none, selective, full")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 30; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="start no new system after this many seconds (the whole run must stay under 8 minutes)")
    p.add_argument("--profile", type=int, default=0,
                   help="profile this many more steps per system: device time by kernel kind, busy fraction")
    p.add_argument("--out", type=Path, default=None, help="write gpu_bench.json here")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU: checks the script end to end")
    args = p.parse_args(argv)
    args.sizes = (args.sizes or ",".join(TINY_SIZES if args.cpu_smoke else ("1.3b", "2.7b"))).split(",")
    args.precisions = args.precisions.split(",")
    args.systems = args.systems.split(",")
    args.variants = args.variants.split(",")
    args.recompute = args.recompute.split(",")
    args.steps = args.steps or (2 if args.cpu_smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu_smoke else 3)
    if not args.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU machine, or use --cpu-smoke to check the script on a CPU")
    if args.cpu_smoke:
        torch.set_num_threads(1)
        if "fp16" in args.precisions:
            # DeepSpeed refuses fp16 on a CPU accelerator; the smoke test only checks the code path
            from deepspeed.accelerator import get_accelerator
            get_accelerator().is_fp16_supported = lambda: True
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    common.quiet_deepspeed()
    init_distributed()
    initialize_model_parallel(1, 1)
    common.quiet_deepspeed()
    return run(args)


if __name__ == "__main__":
    main()
