"""GPT training step, TP=1, one process: the project through DeepSpeed against Hugging Face, side by side.

The systems train the same model shapes on the same batch with the same optimizer (torch AdamW with the
DeepSpeed config's hyper-parameters and foreach/fused choice, fused by default, no weight decay on 1-D
tensors, gradient clipping 1.0) in the same precision:

  deepspeed     the project's GPT through ``pipeline.engine.build.build_engine`` (a one-rank gloo group) and
                ``pipeline.engine.steps.train_step``, with the project's CPU DeepSpeed config (ds_configs/cpu.json:
                ZeRO-1; bf16 on, or off for fp32);
  deepspeed-z0  the same with ZeRO stage 0 (at one rank ZeRO-1 partitions nothing and only adds copies);
  hf            ``transformers``' GPT2LMHeadModel (gpt2) / LlamaForCausalLM (llama), SDPA attention, in a
                plain PyTorch loop (forward, backward, clip, step, zero_grad);
  plain         the project's GPT in the same plain loop: the difference to ``deepspeed`` is the engine's cost.

``NAME+compile`` (or ``--compile`` for every system) compiles that system: the project's systems per transformer
block (``models.compile.compile_transformer_layers``, torchtitan's way: the embedding, output layer, loss and
DeepSpeed's engine and hooks stay eager), Hugging Face's whole model with ``torch.compile``. The first (warm-up)
step pays the compilation. ``NAME+fp8`` (or ``+fp8-rowwise``) runs the project's column- and row-parallel linears
in FP8 with torchao's recipe, as ``--fp8`` does; on a CPU that measures torch's emulated ``_scaled_mm``, not FP8
hardware.

Precision. fp32: everything fp32. bf16: DeepSpeed keeps bf16 weights and activations and an fp32 master
copy that its optimizer updates; the plain loops get the matching standard treatment, fp32 weights
with ``torch.autocast(bfloat16)`` (bf16 matrix products and activations, fp32 weights = master weights,
fp32 optimizer). The loss is computed from fp32 logits in all of them. Dropout is 0 everywhere, unless ``--dropout P``: hidden and
attention dropout P in the project's systems (Hugging Face's stay at 0, as an export leaves them), the model-parallel
RNG seeded as a job seeds it, so the attention's dropout draws from its tracked stream.

One precision at a time (engines of two precisions alive in one process slow each other's heap, unlike a
training process): each round times one step of every system of that precision and one matrix-product loop
(the peak MFU is measured against), the order rotating each round; warm-up steps are not timed. Ratios are
medians over rounds of the per-round ratios, so load on a shared machine cancels out; bf16/fp32 compares the
two precisions' medians, timed one after the other. With one torch thread (the
default) steps are timed in process CPU time, which leaves out the time spent waiting for a core on a
busy machine; ``--clock wall`` for wall time. MFU = model FLOPs per second (``GPTConfig.flops_per_token``,
PaLM's count, checked here against torch's FLOP counter) over the measured matmul rate in the same precision.

    python bench/train_step.py [--variants gpt2,llama] [--sizes small,medium] [--precisions fp32,bf16]
                               [--systems deepspeed,deepspeed-z0,hf,plain] [--rounds 8] [--threads 1]
                               [--clock cpu|wall] [--compile] [--dropout P] [--profile DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from common import CPU_SIZES, ROOT, System, format_table, interleaved, median, paired_ratio  # noqa: E402
from torch.profiler import ProfilerActivity
from torch.profiler import profile as tprofile

from models import GPT
from models.compile import compile_transformer_layers
from models.parallel.fp8 import enable_fp8
from models.parallel import get_parallel_state, initialize_model_parallel, model_parallel_seed
from pipeline.engine.distributed import init_distributed
from pipeline.engine.build import build_engine, param_groups
from pipeline.engine.host_memory import keep_freed_host_memory, user_set_allocator
from pipeline.engine.ds_config import load_ds_config, resolve_ds_config
from pipeline.engine.steps import train_step

SYSTEMS = ("deepspeed", "deepspeed-z0", "hf", "plain")


def bench_ds_config(base: dict, precision: str, micro: int, zero_stage: int | None = None) -> dict:
    """The project's DeepSpeed config at this precision and batch (one rank, no accumulation). A precision
    section the config enables itself (e.g. fp16_zero1.json's loss scaling) is kept as it is."""
    own = base.get(precision, {}) if precision != "fp32" and base.get(precision, {}).get("enabled") else None
    ds = {k: v for k, v in base.items() if k not in ("bf16", "fp16", "peak_tflops", "train_batch_size",
                                                      "gradient_accumulation_steps")}
    if precision != "fp32":
        ds[precision] = own or {"enabled": True, **({"loss_scale": 0, "initial_scale_power": 16}
                                                     if precision == "fp16" else {})}
    if zero_stage is not None:
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": zero_stage}
    return resolve_ds_config(ds, data_parallel=1, micro_batch_size=micro, global_batch_size=micro)


def plain_optimizer(model, ds: dict):
    """The optimizer DeepSpeed builds for ``torch_adam`` configs, for a plain loop: torch AdamW, same
    hyper-parameters, same foreach/fused choice, same parameter groups."""
    opt = ds["optimizer"]
    if opt["type"].lower() not in ("adamw", "adam") or not opt["params"].get("torch_adam"):
        raise SystemExit(f"the benchmark compares torch AdamW everywhere; the DeepSpeed config has {opt}")
    params = {k: v for k, v in opt["params"].items() if k not in ("torch_adam", "adam_w_mode")}
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return torch.optim.AdamW(param_groups(model), **params)


def plain_step_fn(model, optimizer, loss_fn, precision: str, clip: float, device):
    """forward under autocast, backward, clip, step, zero_grad; fp16 with torch's dynamic loss scaler."""
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = torch.amp.GradScaler(str(device).split(":")[0]) if precision == "fp16" else None

    def step():
        with common.autocast(device, precision):
            loss = loss_fn()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)
    return step


def make_system(name: str, config, tokens, precision: str, base_ds: dict, *, device="cpu", zero_stage=None,
                compile=False, seed=1234, recompute="none") -> System:
    """One contender for one (model, precision), owning its model, optimizer and step function.

    ``name``: deepspeed (the config's ZeRO stage), deepspeed-zN (ZeRO stage N), hf, plain; a "+compile"
    suffix compiles that one system's model (the project's per block, Hugging Face's whole); "+fp8" (tensorwise)
    or "+fp8-rowwise" runs the project's parallel linears in FP8 (``--fp8``). ``recompute``: the
    engine's activation recomputation policy (none, selective, full; DeepSpeed systems only)."""
    label = name
    name, *mods = name.split("+")
    compile = compile or "compile" in mods
    fp8 = next((m.split("-", 1)[1] if "-" in m else "tensorwise" for m in mods if m.startswith("fp8")), None)
    if set(mods) - {"compile", "fp8", "fp8-tensorwise", "fp8-rowwise"}:
        raise ValueError(f"unknown system {label!r}: a suffix is +compile, +fp8 or +fp8-rowwise")
    if name.startswith("deepspeed-z"):
        zero_stage = int(name.split("-z")[1])
    ds = bench_ds_config(base_ds, precision, tokens.shape[0], zero_stage)
    clip = float(ds.get("gradient_clipping", 0.0))
    x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    torch.manual_seed(seed)
    if name.startswith("deepspeed"):
        engine = build_engine(config, ds, get_parallel_state(), init_seed=seed, recompute=recompute)
        if fp8:  # what --fp8 does (build_engine applies the layout's recipe; this bench's state has none)
            enable_fp8(engine.module, fp8)
        if compile:
            compile_transformer_layers(engine.module)
        batches = _repeat((x, y))
        return System(f"{label} {precision}", lambda: train_step(engine, batches), owner=engine)
    if name == "plain":
        model = GPT(config, init_seed=seed).to(device).train()
        if fp8:
            enable_fp8(model, fp8)
        if compile:
            compile_transformer_layers(model)
        opt = plain_optimizer(model, ds)
        return System(f"{label} {precision}", plain_step_fn(model, opt, lambda: model(x, y), precision, clip, device),
                      owner=(model, opt))
    if name == "hf":
        model = common.hf_model(config, device)
        fwd = torch.compile(model) if compile else model
        opt = plain_optimizer(model, ds)
        return System(f"{label} {precision}", plain_step_fn(
            model, opt, lambda: fwd(input_ids=x, labels=x, use_cache=False).loss, precision, clip, device),
            owner=(model, opt))
    raise ValueError(f"unknown system {name!r}; choose deepspeed, deepspeed-zN, hf or plain")


def make_systems(config, tokens, precision: str, base_ds: dict, which, **kwargs) -> list[System]:
    return [make_system(name, config, tokens, precision, base_ds, **kwargs) for name in which]


def _repeat(item):
    while True:
        yield item


def check_flops(config, tokens, device="cpu") -> dict:
    """PaLM's formula against torch's op-by-op count of one forward + backward of both models."""
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    n_tokens = x.numel()
    formula = config.flops_per_token(x.shape[1]) * n_tokens
    ours = GPT(config, init_seed=0).to(device)
    counted = common.count_training_flops(lambda: ours(x, y).backward())  # noqa: F821 (deleted below, after use)
    hf = common.hf_model(config, device)
    counted_hf = common.count_training_flops(lambda: hf(input_ids=x, labels=x, use_cache=False).loss.backward())  # noqa: F821
    del ours, hf
    return {"formula": formula, "counted_project": counted, "counted_hf": counted_hf}


def run_size(variant: str, size_name: str, size: dict, precisions, args, base_ds) -> list[dict]:
    config = dataclasses.replace(common.model_config(size, variant), hidden_dropout=args.dropout,
                                 attention_dropout=args.dropout)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (size["batch"], size["seq"] + 1), generator=g)
    flops = check_flops(config, tokens)
    rel = abs(flops["counted_project"] - flops["formula"]) / flops["formula"]
    print(f"\n## {variant} {size_name}: {config.num_parameters() / 1e6:.1f}M parameters, batch {size['batch']} x "
          f"seq {size['seq']}; FLOPs per step: formula {flops['formula'] / 1e9:.2f} G, counted (torch FLOP counter, "
          f"fwd+bwd) project {flops['counted_project'] / 1e9:.2f} G, HF {flops['counted_hf'] / 1e9:.2f} G "
          f"(formula vs project count: {rel:.1e})")
    if rel > 0.01:
        raise SystemExit(f"flops_per_token disagrees with the counted FLOPs by {rel:.1%}")

    # one precision at a time, its systems released before the next: engines of both precisions alive in one
    # process interleave their per-step buffers in the heap, which cost gpt2's bf16 engine 4 points of "x plain"
    # that a training process (one precision) does not pay
    step_flops = flops["formula"]
    n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    rows = []
    for p in precisions:
        systems = make_systems(config, tokens, p, base_ds, args.systems, zero_stage=args.zero_stage,
                               compile=args.compile)
        peak = System(f"matmul {p}", lambda d=common.DTYPES[p]: common.matmul_peak(d, seconds=args.peak_seconds,
                                                                                  clock=args.clock))
        timed = interleaved(systems + [peak], args.rounds, args.warmup, progress=f"{variant} {size_name} {p}",
                            clock=args.clock)
        hf_times, plain_times = timed.get(f"hf {p}"), timed.get(f"plain {p}")
        for name in args.systems:
            t = timed[f"{name} {p}"]
            mfu = median(step_flops / ti / pk for ti, pk in zip(t, peak.results))
            rows.append({"variant": variant, "size": size_name, "precision": p, "system": name,
                         "tokens_per_s": n_tokens / median(t), "step_s": median(t),
                         "vs_hf": paired_ratio(hf_times, t) if hf_times else None,
                         "vs_plain": paired_ratio(plain_times, t) if plain_times else None,
                         "tflops": step_flops / median(t) / 1e12, "mfu": mfu,
                         "peak_tflops": median(peak.results) / 1e12, "times": t})
        for s in systems:
            common.release(s)
        del systems, timed
        gc.collect()
    if "fp32" in precisions and "bf16" in precisions:
        for name in args.systems:
            r32 = next(r for r in rows if r["system"] == name and r["precision"] == "fp32")
            r16 = next(r for r in rows if r["system"] == name and r["precision"] == "bf16")
            r16["bf16_vs_fp32"] = r16["tokens_per_s"] / r32["tokens_per_s"]  # timed one after the other
    return rows


def print_tables(rows):
    headers = ["model", "precision", "system", "tokens/s", "x HF", "x plain", "bf16/fp32", "TFLOP/s", "peak TFLOP/s", "MFU"]
    table = [[f"{r['variant']} {r['size']}", r["precision"], r["system"], r["tokens_per_s"],
              "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}",
              "-" if r.get("vs_plain") is None else f"{r['vs_plain']:.3f}",
              f"{r['bf16_vs_fp32']:.2f}" if "bf16_vs_fp32" in r else "",
              r["tflops"], r["peak_tflops"], f"{100 * r['mfu']:.1f}%"] for r in rows]
    print(format_table(headers, table))


def profile(args, base_ds, out_dir: Path):
    """torch.profiler tables of each system's step (first size and variant), to see where time goes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    variant, size_name = args.variants[0], args.sizes[0]
    size = CPU_SIZES[size_name]
    config = dataclasses.replace(common.model_config(size, variant), hidden_dropout=args.dropout,
                                 attention_dropout=args.dropout)
    tokens = torch.randint(0, config.vocab_size, (size["batch"], size["seq"] + 1))
    for p in args.precisions:
        for s in make_systems(config, tokens, p, base_ds, args.systems, zero_stage=args.zero_stage,
                              compile=args.compile):
            for _ in range(args.warmup):
                s.step()
            with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(2):
                    s.step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            path = out_dir / f"{variant}-{size_name}-{s.name.replace(' ', '-')}.txt"
            path.write_text(table)
            print(f"\n### {s.name}: {path}\n{table}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="gpt2,llama")
    p.add_argument("--sizes", default="small,medium", help=f"of {', '.join(CPU_SIZES)}")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="deepspeed (the config's ZeRO stage), deepspeed-zN (ZeRO stage N), hf, plain; "
                        "NAME+compile compiles that system (e.g. plain,plain+compile)")
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "cpu.json"),
                   help="the DeepSpeed config of the deepspeed system (its optimizer is used by all)")
    p.add_argument("--zero-stage", type=int, default=None, help="override the config's ZeRO stage")
    p.add_argument("--rounds", type=int, default=8, help="timed steps of each system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each system first")
    p.add_argument("--peak-seconds", type=float, default=0.3, help="length of each matmul-peak measurement")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared, busy machine one thread per process is steadier)")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="time with this process's CPU time (default with one thread: robust to other jobs on a "
                        "shared machine) or wall time (default with several threads)")
    p.add_argument("--compile", action="store_true", help="compile every system (the project's per transformer block, Hugging Face's whole)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout of the project's systems (Hugging Face's stay at 0)")
    p.add_argument("--profile", type=Path, default=None, help="write torch.profiler tables here instead of timing")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    args.sizes = args.sizes.split(",")
    args.precisions = args.precisions.split(",")
    args.systems = args.systems.split(",")
    torch.set_num_threads(args.threads)
    if args.clock is None:
        args.clock = "cpu" if args.threads == 1 else "wall"
    common.quiet_deepspeed()

    init_distributed()
    initialize_model_parallel(1, 1)
    model_parallel_seed(1234)  # as a job: dropout on TP-split activations draws from the tracked stream
    common.quiet_deepspeed()
    base_ds = load_ds_config(args.ds_config)
    if args.profile:
        return profile(args, base_ds, args.profile)

    print(f"# GPT training step, TP=1, one process: {common.machine_note()}")
    # every system in this process under the allocator policy the engine sets for itself (build_engine)
    kept = keep_freed_host_memory()
    print(f"# freed host memory kept for reuse (pipeline.engine.host_memory): {'yes' if kept else 'no'}"
          f"{' (the user set MALLOC_* / GLIBC_TUNABLES)' if user_set_allocator() else ''}")
    print(f"# DeepSpeed config {Path(args.ds_config).name} (ZeRO-{args.zero_stage if args.zero_stage is not None else base_ds.get('zero_optimization', {}).get('stage', 0)}), "
          f"{args.warmup} warm-up + {args.rounds} timed steps per system, interleaved; medians of {args.clock} time; "
          f"the machine may be shared, so single numbers are noisy, ratios less so")
    rows = []
    for variant in args.variants:
        for size_name in args.sizes:
            rows += run_size(variant, size_name, CPU_SIZES[size_name], args.precisions, args, base_ds)
            print_tables([r for r in rows if r["variant"] == variant and r["size"] == size_name])
    print("\n# All results (x HF: tokens/s over Hugging Face's in the same precision; x plain: over the plain "
          "loop's, the engine's cost; bf16/fp32: over the same system's fp32)")
    print_tables(rows)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "times"} | {"times": r["times"]}
                                         for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
