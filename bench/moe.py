"""A mixture of experts against the dense GPT of the same active FLOPs, trained by the main job on the same tokens.

    python bench/moe.py [--steps 200] [--work DIR] [--out bench/results/moe.json]
    python bench/moe.py --dispatch [--rounds 20] [--out bench/results/moe_dispatch.json]
    python bench/moe.py --dispatch --profile
    python bench/moe.py --dispatch --products
    python bench/moe.py --balancing [--steps 1000] [--out bench/results/moe_balancing.json]
    python bench/moe.py --balancing --systems "v3 aux loss,v3 aux-loss-free" --seeds 1234,1,2 \
        --out bench/results/moe_balancing_seeds.json

``--balancing``: a DeepSeek-V3-style MoE (``V3``: a dense first layer, 16 fine-grained experts in 4 groups, top-4
within the best 2, sigmoid scores, a shared expert, grouped products) trained 1000 steps by the main job four
ways by default: with the sequence-wise auxiliary loss (coefficient 0.01; ``v3 aux loss 0.03`` and ``0.1`` by name),
with auxiliary-loss-free balancing (the per-expert bias, rate 1e-3 as DeepSeek-V3, and 1e-2, no loss; ``rate 3e-3``
by name), and with neither. Reported: the max/mean expert load over training and the validation loss, the job's own
over training and, at the end, the last checkpoint's on the whole held-out split (DeepSeek-V3's claim: the bias
balances as well as the loss without its cost in quality). ``--seeds``: each system once per seed (the initial
weights, the data order and the held-out documents change with it), the final whole-split losses summarised over
them, paired against the first system's at each seed: a difference between two systems means something only beside
the spread of the seeds. Runs repeat bit for bit on one machine, not across machines: compare runs of one machine.

``--dispatch``: one DeepSeek-style MoE layer (``DEEPSEEK_STYLE``: h 256, 64 fine-grained experts of FFN 128, top-8
within the best 4 of 8 groups, sigmoid scores with the balancing bias, 2 shared experts' width), a training step
(forward and backward) on 4 x 128 tokens and on 1 x 32, its local experts as grouped products (``moe_grouped_gemm``,
models/moe/grouped.py), as batched products over rows padded per expert (the path where ``torch._grouped_mm`` does
not fit) and as the per-expert loop, in fp32 and bf16, on one torch thread, the systems
interleaved (bench/common.py) and timed by the process's CPU time. Goal (issue 43): the grouped dispatch >= 3x
the loop's tokens/s.

Every system is ``pipeline.pretrain`` (DeepSpeed, ``ds_configs/cpu.json``: bf16, ZeRO-1; ``--precision fp32``
drops its bf16 section) on the same corpus (the shared English Wikipedia sample, byte tokenizer), the same seed,
batch and schedule, so every one sees the same tokens in the same order:

- ``dense``: a small llama (h 128, 4 layers, SwiGLU FFN 512);
- ``moe``: every layer's FFN replaced by 8 experts of FFN 256, top-2, dropless, load-balancing loss 0.01: the
  active FFN FLOPs per token equal the dense model's (2 x 256 = 512; the router adds 8 x h per token);
- ``moe without balancing loss``: the same with the coefficient 0, to see the load without it;
- ``dense DP2`` and ``moe EP2``: the first two on 2 ranks (torchrun), the experts split 4 + 4 (EP2 = DP2);
- ``dense micro 4`` and ``moe micro 4``: the first two with 4 micro-batches of 4 sequences (512 tokens) per
  step instead of one of 16: each expert then multiplies a quarter of the rows at a time.

Each rank computes on one thread (a 1-rank system on one core, a 2-rank one on two). Reported per system:
tokens/s (the median of the job's logged intervals after the first), the peak RSS of a rank, the validation
loss after the same tokens, and the max/mean expert load (the mean over MoE layers of the job's
``moe_load_ratio_i``) over training. Goals (issue 24): the MoE's validation loss below the dense one's at
equal active FLOPs, its tokens/s within 25% of the dense model's. Writes JSON and a plot (load over training,
validation loss against tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import System, format_table, interleaved, machine_note, median, paired_ratio  # noqa: E402
from models.config import GPTConfig  # noqa: E402
from models.moe import MoEMLP  # noqa: E402
from models.moe.grouped import GROUPED_MM_DTYPES  # noqa: E402
from models.parallel import Layout  # noqa: E402
from pipeline.data.build import build_pretraining_data, run_tokenizer  # noqa: E402
from pipeline.engine.distributed import init_distributed  # noqa: E402
from pipeline.evaluation.lm_scoring.loading import load_project_model  # noqa: E402
from pipeline.job.files import atomic_write_figure, atomic_write_json  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "corpora" / "wikipedia.txt"
DENSE = {"variant": "llama", "hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4,
         "ffn_hidden_size": 512, "max_position_embeddings": 256, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "tie_embeddings": False}
MOE = {**DENSE, "num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 256, "moe_aux_loss_coeff": 0.01}
# DeepSeek-V3's generation at the same size: a dense first layer, 16 fine-grained experts of FFN 64 in 4 groups (top-4
# within the best 2), sigmoid scores scaled by 2.5, a shared expert of FFN 128 (active FFN 4 x 64 + 128 = 384)
V3 = {**DENSE, "num_experts": 16, "moe_top_k": 4, "moe_ffn_hidden_size": 64, "moe_dense_layers": [0],
      "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4, "moe_router_group_topk": 2,
      "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 128, "moe_grouped_gemm": True,
      "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}
SYSTEMS = {  # name -> (model, ranks, extra flags)
    "dense": (DENSE, 1, []),
    "moe": (MOE, 1, []),
    "moe without balancing loss": ({**MOE, "moe_aux_loss_coeff": 0.0}, 1, []),
    "dense DP2": (DENSE, 2, []),
    "moe EP2": (MOE, 2, ["--expert-parallel", "2"]),
    "dense micro 4": (DENSE, 1, ["--micro-batch-size", "4"]),
    "moe micro 4": (MOE, 1, ["--micro-batch-size", "4"]),
    # balancing (issue 43): the sequence-wise auxiliary loss, DeepSeek-V3's bias (no auxiliary loss), neither
    "v3 aux loss": ({**V3, "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-2}, 1, []),
    # the sequence-wise loss stronger: faster balance at what cost in quality (the trade-off the bias is to beat)
    **{f"v3 aux loss {coeff}": ({**V3, "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": coeff},
                                1, []) for coeff in (0.03, 0.1)},
    "v3 aux-loss-free": ({**V3, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3}, 1, []),
    "v3 aux-loss-free rate 1e-2": ({**V3, "moe_router_enable_expert_bias": True,
                                     "moe_router_bias_update_rate": 1e-2}, 1, []),
    "v3 aux-loss-free rate 3e-3": ({**V3, "moe_router_enable_expert_bias": True,
                                     "moe_router_bias_update_rate": 3e-3}, 1, []),
    # the bias's rate decaying with the LR after warmup (0 at the end, as DeepSeek-V3 freezes it for its last tokens)
    "v3 aux-loss-free rate 1e-2 lr schedule": ({**V3, "moe_router_enable_expert_bias": True,
                                                "moe_router_bias_update_rate": 1e-2,
                                                "moe_router_bias_rate_schedule": "lr"}, 1, []),
    # DeepSeek-V3's recipe: the bias and a very small sequence-wise loss beside it (its alpha 1e-4)
    "v3 aux-loss-free rate 1e-2 and seq loss 1e-4": ({**V3, "moe_router_enable_expert_bias": True,
                                                      "moe_router_bias_update_rate": 1e-2,
                                                      "moe_router_load_balancing_type": "seq_aux_loss",
                                                      "moe_aux_loss_coeff": 1e-4}, 1, []),
    "v3 unbalanced": (V3, 1, []),
}
SEED = 1234  # every system's (--seeds adds others: the weights' init and the data order change with it)
DEFAULT_SYSTEMS = ("dense", "moe", "moe without balancing loss", "dense DP2", "moe EP2", "dense micro 4", "moe micro 4")
BALANCING = ("v3 aux loss", "v3 aux-loss-free", "v3 aux-loss-free rate 1e-2", "v3 unbalanced")
DEEPSEEK_STYLE = {"variant": "llama", "hidden_size": 256, "num_layers": 1, "num_heads": 4, "ffn_hidden_size": 512,
                  "max_position_embeddings": 128, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                  "num_experts": 64, "moe_top_k": 8, "moe_ffn_hidden_size": 128, "moe_router_score_function": "sigmoid",
                  "moe_router_num_groups": 8, "moe_router_group_topk": 4, "moe_router_topk_scaling_factor": 2.5,
                  "moe_router_enable_expert_bias": True, "moe_router_load_balancing_type": "seq_aux_loss",
                  "moe_aux_loss_coeff": 1e-4, "moe_shared_expert_intermediate_size": 256}
BASELINES = {"dense DP2": "dense DP2", "moe EP2": "dense DP2", "dense micro 4": "dense micro 4",
             "moe micro 4": "dense micro 4"}  # the dense system each one's tokens/s is compared with (else dense)
# what init_distributed set for the scoring's one-rank group (whole_validation_loss): not a job's to inherit
GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# peak RSS of the job's processes (the launcher's children included), read after it ends
_MEASURED = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[2:]).returncode; "
             "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
             "sys.exit(r)")


def ds_config(work: Path, precision: str) -> Path:
    """ds_configs/cpu.json as it is (bf16), or without its bf16 section (fp32: for a CPU without bf16 units)."""
    if precision == "bf16":
        return ROOT / "ds_configs" / "cpu.json"
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config.pop("bf16", None)
    path = work / "ds_config_fp32.json"
    path.write_text(json.dumps(config))
    return path


def command(work: Path, name: str, steps: int, seq: int, batch: int, precision: str = "bf16",
            seed: int = SEED) -> list[str]:
    model, ranks, extra = SYSTEMS[name]
    d = work / (name.replace(" ", "_").replace(",", "") + ("" if seed == SEED else f"_seed{seed}"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.json").write_text(json.dumps(model))
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
              if ranks > 1 else [sys.executable])
    return [*launch, "-m", "pipeline.pretrain", "--model-config", str(d / "model.json"),
            "--deepspeed_config", str(ds_config(work, precision)), "--data", str(CORPUS),
            "--tokenizer", "bytes", "--seq-length", str(seq), "--global-batch-size", str(batch),
            "--micro-batch-size", str(batch // ranks), "--train-steps", str(steps), "--lr", "2e-3",
            "--lr-warmup-steps", str(steps // 10), "--lr-decay-style", "cosine", "--eval-interval", str(steps // 4),
            "--eval-iters", "8", "--log-interval", "10", "--cache-dir", str(work / "cache"), "--seed", str(seed),
            "--save", str(d / "run"), "--save-interval", str(10 * steps), *extra]


def run_system(work: Path, name: str, args, seed: int = SEED) -> dict:
    cmd = command(work, name, args.steps, args.seq_length, args.global_batch_size, args.precision, seed)
    run_dir = Path(cmd[cmd.index("--save") + 1])
    records_file = run_dir / "metrics.jsonl"
    if not records_file.is_file() or not any('"valid_loss"' in line and f'"step": {args.steps}' in line
                                             for line in records_file.read_text().splitlines()):
        rss_file = run_dir.parent / "max_rss_kib"
        env = {**{k: v for k, v in os.environ.items() if k not in GROUP_ENV},
               "OMP_NUM_THREADS": "1",  # one thread per rank: the same share of a shared machine
               "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        print(f"{name}: training {args.steps} steps", flush=True)
        before = os.getloadavg()
        subprocess.run([sys.executable, "-c", _MEASURED, str(rss_file), *cmd], check=True, cwd=work, env=env)
        (run_dir.parent / "load_average.json").write_text(json.dumps({"before": before, "after": os.getloadavg()}))
    records = [json.loads(line) for line in records_file.read_text().splitlines() if line.strip()]
    load_file = run_dir.parent / "load_average.json"
    return {**summarize(records, (run_dir.parent / "max_rss_kib").read_text()),
            **whole_validation_loss(run_dir, seed, args.seq_length, work),
            "load_average": json.loads(load_file.read_text()) if load_file.is_file() else None}


def whole_validation_loss(run_dir: Path, seed: int, seq: int, work: Path, batch: int = 64) -> dict:
    """The run's last checkpoint scored on its whole validation split (fp32, one process), where the job's own
    validation reads only --eval-iters batches of it (8 x 16 sequences: at 16k bytes, differences of 0.5% between
    systems are within that sample's noise). Cached beside the run."""
    cached = run_dir.parent / "whole_validation.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    init_distributed()  # a one-rank group: the checkpoint reader builds the model's parallel state
    model, _ = load_project_model(run_dir)
    _, valid = build_pretraining_data(str(CORPUS), run_tokenizer(run_dir, None, "bytes"), seq, seed=seed,
                                      cache_dir=str(work / "cache"))
    sequences = torch.stack([torch.as_tensor(valid[i]) for i in range(len(valid))])
    total = 0.0
    with torch.no_grad():
        for rows in sequences.split(batch):
            total += float(model(rows[:, :-1], rows[:, 1:])) * len(rows)  # the mean over each row's tokens
    result = {"whole_valid_loss": total / len(sequences), "whole_valid_sequences": len(sequences)}
    atomic_write_json(cached, result)
    return result


def summarize(records: list[dict], max_rss_kib: str) -> dict:
    steps = [r for r in records if "tokens_per_s" in r]
    valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    loads = [(r["step"], statistics.mean(v for k, v in r.items() if k.startswith("moe_load_ratio_")))
             for r in records if any(k.startswith("moe_load_ratio_") for k in r)]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]),
            "final_valid_loss": valid[-1][1], "valid_loss": valid,
            "final_train_loss": statistics.mean(r["loss"] for r in steps[-3:]),
            "max_rss_mib_per_rank": int(max_rss_kib) / 1024,
            "load_max_mean": loads, "final_load_max_mean": statistics.mean(v for _, v in loads[-3:]) if loads else None}


def plot(results: dict, tokens_per_step: int, out: Path, over_seeds: dict | None = None) -> Path:
    """Load over training and validation loss against tokens, each system at the first seed; with several seeds a
    third panel: each system's final loss on the whole validation split at every seed (a line per seed)."""
    from matplotlib.figure import Figure  # noqa: PLC0415  (matplotlib only to draw)

    first = next(iter(results))  # the results run seed by seed: the first seed's names share the first's suffix
    suffix = first[first.index(" seed "):] if " seed " in first else ""
    first_seed = {name: r for name, r in results.items() if (name.endswith(suffix) if suffix else " seed " not in name)}
    fig = Figure(figsize=(15 if over_seeds else 10, 3.8), layout="constrained")
    load, valid, *seeds = fig.subplots(1, 3 if over_seeds else 2)
    for i, (name, r) in enumerate(first_seed.items()):  # one color per system in both panels
        if r["load_max_mean"]:
            load.plot(*zip(*r["load_max_mean"]), color=f"C{i}", label=name)
        valid.plot([s * tokens_per_step for s, _ in r["valid_loss"]], [v for _, v in r["valid_loss"]], marker="o",
                   color=f"C{i}", label=name)
    load.set(title="max/mean expert load (mean over MoE layers)", xlabel="step", ylabel="max / mean tokens")
    valid.set(title=f"validation loss (first seed, {len(first_seed)} systems)", xlabel="tokens",
              ylabel="loss (nats/byte)")
    if over_seeds:
        names = list(over_seeds)
        values = [over_seeds[n]["values"] for n in names]
        for j, seed in enumerate(over_seeds[names[0]]["seeds"]):
            seeds[0].plot(range(len(names)), [v[j] for v in values], marker="o", label=f"seed {seed}")
        seeds[0].set_xticks(range(len(names)), [n.replace("v3 ", "").replace(" rate", "\nrate") for n in names],
                            fontsize=7)
        seeds[0].set(title="final loss, whole validation split", ylabel="loss (nats/byte)")
    for ax in (load, valid, *seeds):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return atomic_write_figure(out, fig, dpi=110)


DISPATCH_SYSTEMS = ("grouped", "padded", "loop")  # _grouped_mm, the batched products over padded rows, the loop


def dispatch_systems(dtype: torch.dtype, batch: int = 4, seq: int = 128) -> list[System]:
    """A training step of the DeepSeek-style MoE layer, the same weights and tokens: ``moe_grouped_gemm`` as it runs
    (``torch._grouped_mm`` in fp32, the padded batched products in bf16 on a CPU), the batched products over rows
    padded per expert forced (``GROUPED_MM_DTYPES`` emptied during its steps), and the per-expert loop."""
    systems = []
    for name in DISPATCH_SYSTEMS:
        torch.manual_seed(0)
        layer = MoEMLP(GPTConfig(**DEEPSEEK_STYLE, moe_grouped_gemm=name != "loop"), Layout(), 0.02, 0.01)
        layer = layer.to(dtype).train()
        x = torch.randn(batch, seq, DEEPSEEK_STYLE["hidden_size"], generator=torch.Generator().manual_seed(1)).to(dtype)

        def step(layer=layer, x=x, padded=name == "padded"):
            kept = GROUPED_MM_DTYPES["cpu"]
            GROUPED_MM_DTYPES["cpu"] = () if padded else kept
            try:
                layer.zero_grad(set_to_none=True)
                (layer(x).float().square().mean() + layer.aux_loss).backward()
            finally:
                GROUPED_MM_DTYPES["cpu"] = kept
        systems.append(System(name, step, owner=layer))
    return systems


def dispatch_profile(dtype: torch.dtype, steps: int = 3, top: int = 10) -> None:
    """Each system's busiest operators over ``steps`` steps at 512 tokens (torch.profiler, self CPU time)."""
    from torch.profiler import profile  # noqa: PLC0415  (only for --profile)

    for system in dispatch_systems(dtype):
        for _ in range(2):
            system.step()
        with profile() as prof:
            for _ in range(steps):
                system.step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n{system.name} ({dtype}): {total / steps / 1e3:.1f} ms of CPU per step")
        for e in events[:top]:
            print(f"  {e.key:45s} {e.self_cpu_time_total / steps / 1e3:7.2f} ms  {e.count // steps:5d} calls")


def expert_products(rounds: int = 50, experts: int = 64, width: int = 256) -> None:
    """The floor under the grouped experts on a CPU: one linear of ``experts`` experts ([rows, width] times each
    expert's [width, width]) as one batched product, as a loop of one product per expert, and, for scale, one
    product of the same FLOPs against a single weight; CPU time of one thread. With few rows per expert the batched
    product reads every expert's weights once (experts x width^2 x 2 bytes in bf16) and runs at the core's memory
    bandwidth; the loop reads them as well, and pays a call per expert."""
    torch.set_num_threads(1)
    rows_table = []
    for rows in (4, 64):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(experts, rows, width, dtype=dtype)
            w = torch.randn(experts, width, width, dtype=dtype).transpose(1, 2)
            flat, single = x.reshape(-1, width), w[0]
            systems = [System("batched", lambda: torch.bmm(x, w)),
                       System("loop", lambda: [torch.mm(x[e], w[e]) for e in range(experts)]),
                       System("one weight", lambda: torch.mm(flat, single))]
            times = interleaved(systems, rounds, warmup=3, clock="cpu")
            ms = {name: median(t) * 1e3 for name, t in times.items()}
            weight_bytes = w.numel() * w.element_size()
            rows_table.append([rows, str(dtype).removeprefix("torch."), ms["batched"], ms["loop"], ms["one weight"],
                               weight_bytes / ms["batched"] / 1e6])
    print(format_table(["rows per expert", "dtype", "batched ms", "loop ms", "one weight ms",
                        "batched: weights read GB/s"], rows_table))
    print(machine_note())


def dispatch_benchmark(rounds: int, out: Path) -> None:
    torch.set_num_threads(1)
    results, rows = {}, []
    for batch, seq in ((4, 128), (1, 32)):
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            before, tokens = os.getloadavg(), batch * seq
            times = interleaved(dispatch_systems(dtype, batch, seq), rounds, warmup=2, clock="cpu")
            speedup = {name: paired_ratio(times["loop"], times[name]) for name in ("grouped", "padded")}
            results[f"{tokens} tokens {precision}"] = {
                **{name: {"tokens_per_s": tokens / median(t), "seconds": t} for name, t in times.items()},
                "speedup": speedup["grouped"], "padded_speedup": speedup["padded"],
                "load_average": {"before": before, "after": os.getloadavg()}}
            rows.append([tokens, precision, tokens / median(times["grouped"]), tokens / median(times["padded"]),
                         tokens / median(times["loop"]), speedup["grouped"], speedup["padded"],
                         f"{before[0]:.1f} -> {os.getloadavg()[0]:.1f}"])
    print(format_table(["tokens", "precision", "grouped tok/s", "padded tok/s", "loop tok/s", "grouped / loop",
                        "padded / loop", "load average"], rows))
    atomic_write_json(out, {"benchmark": "moe_dispatch", "machine": machine_note(), "model": DEEPSEEK_STYLE,
                            "rounds": rounds, "results": results}, indent=1)
    print("wrote", out)


def seed_summary(results: dict, names: list[str], seeds: list[int], key: str = "whole_valid_loss") -> dict:
    """Each system's final validation loss (``key``) over the seeds: mean, standard deviation, the values, and at
    each seed its relative difference from the first system's (the runs of a seed see the same tokens: paired)."""
    summary = {}
    for name in names:
        values = [results[name if seed == SEED else f"{name} seed {seed}"][key] for seed in seeds]
        summary[name] = {"mean": statistics.mean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "values": values, "seeds": seeds}
    reference = summary[names[0]]["values"]
    for v in summary.values():
        v["paired_vs_first"] = [x / r - 1 for x, r in zip(v["values"], reference)]
    if len(seeds) > 1:
        print(f"\n{key} over seeds {seeds} (paired: against {names[0]}):")
        for name, v in summary.items():
            paired = " ".join(f"{d:+.2%}" for d in v["paired_vs_first"])
            print(f"{name:28s} {v['mean']:.4f} +- {v['stdev']:.4f}  {' '.join(f'{x:.4f}' for x in v['values'])}"
                  f"  paired {paired} (mean {statistics.mean(v['paired_vs_first']):+.2%})")
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="default 200 (--balancing: 1000)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16 (ds_configs/cpu.json) or fp32 (the same without its bf16 section)")
    p.add_argument("--systems", default=None,
                   help="comma-separated names of SYSTEMS (default: the first seven; --balancing: its four)")
    p.add_argument("--balancing", action="store_true",
                   help=f"the DeepSeek-V3-style MoE's balancing: {', '.join(BALANCING)} (default --steps 1000; "
                        f"writes moe_balancing.json and .png)")
    p.add_argument("--work", default=None, help="directory for the runs (reused: a complete run is not redone)")
    p.add_argument("--out", default=None, help="default: bench/results/moe.json (--dispatch: moe_dispatch.json)")
    p.add_argument("--dispatch", action="store_true", help="the grouped expert products against the loop")
    p.add_argument("--rounds", type=int, default=20, help="--dispatch: timed steps of each system")
    p.add_argument("--products", action="store_true",
                   help="--dispatch: instead, one expert linear's products alone (batched, a loop, one weight)")
    p.add_argument("--profile", action="store_true",
                   help="--dispatch: instead of timing, each system's busiest operators (torch.profiler), fp32 and bf16")
    p.add_argument("--seeds", default=str(SEED),
                   help=f"comma-separated seeds, each system trained once per seed (default {SEED}); the others' "
                        f"results are named '<system> seed N', and the validation losses summarised over the seeds")
    args = p.parse_args(argv)
    if args.dispatch and args.products:
        return expert_products()
    if args.dispatch and args.profile:
        torch.set_num_threads(1)
        for dtype in (torch.float32, torch.bfloat16):
            dispatch_profile(dtype)
        return None
    if args.dispatch:
        return dispatch_benchmark(args.rounds, Path(args.out or ROOT / "bench" / "results" / "moe_dispatch.json"))
    if args.balancing:
        args.systems, args.steps = args.systems or ",".join(BALANCING), args.steps or 1000
    args.systems = args.systems or ",".join(DEFAULT_SYSTEMS)
    args.steps = args.steps or 200
    args.out = args.out or str(ROOT / "bench" / "results" / ("moe_balancing.json" if args.balancing else "moe.json"))
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_moe_"))
    seeds = [int(x) for x in args.seeds.split(",")]
    results = {name if seed == SEED else f"{name} seed {seed}": run_system(work, name, args, seed)
               for seed in seeds for name in args.systems.split(",")}
    dense = results.get("dense")
    print(f"{'system':24s} {'tok/s':>8s} {'vs dense':>8s} {'valid loss':>10s} {'RSS MiB/rank':>12s} {'load max/mean':>13s}")
    for name, r in results.items():
        base = results.get(BASELINES.get(name, "dense"), dense)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"  # (--balancing: no dense run)
        load = f"{r['final_load_max_mean']:.2f}" if r["final_load_max_mean"] else "-"
        print(f"{name:24s} {r['tokens_per_s']:8.0f} {ratio:>8s} {r['final_valid_loss']:10.4f} "
              f"{r['max_rss_mib_per_rank']:12.0f} {load:>13s}")
    over_seeds = seed_summary(results, args.systems.split(","), seeds)
    out = Path(args.out)
    note = {"machine": machine_note(), "precision": args.precision, "steps": args.steps, "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
            "models": {"dense": DENSE, "moe": MOE, "v3": V3}}
    atomic_write_json(out, {"benchmark": "moe", **note, "seeds": seeds, "systems": results,
                            **({"over_seeds": over_seeds} if len(seeds) > 1 else {})}, indent=1)
    figure = plot(results, args.seq_length * args.global_batch_size, out.with_suffix(".png"),
                  over_seeds if len(seeds) > 1 else None)
    print("wrote", out, "and", figure)


if __name__ == "__main__":
    main()
