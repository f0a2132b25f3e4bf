"""Long contexts: activation memory per rank at context parallelism 1, 2 and 4, with and without ALST's tiling.

CP gloo CPU ranks (torch.multiprocessing) build the same small bf16 GPT (llama and gpt2, dropout 0) at
``context_parallel`` C (DeepSpeed-Ulysses: each rank holds s / C tokens, attention through DeepSpeed's
all-to-all), untiled and with ``tiled_mlp`` / ``tiled_loss`` (DeepSpeed's TiledMLP and sequence_tiled_compute),
and count the bytes of the tensors autograd saves for the backward of the whole forward (embedding, layers,
output layer, vocab-parallel cross-entropy; ``torch.autograd.graph.saved_tensors_hooks``, each storage once,
parameters left out) at several sequence lengths; the peak RSS of rank 0 is printed beside it (a CPU process
holds far more than the activations: it is an upper bound, not the figure the budget is set on).

The budget per rank is what CP 1 without tiling saves at ``--seq``; the longest sequence that fits it at
each layout comes from the census measured at ``--seq`` and 2 x ``--seq`` (it is linear in s: the SDPA kernel
keeps no [s, s] scores), rounded down to a multiple of 128, and is measured once more at that length to check.
Last, the step time (forward + backward, no optimizer) at ``--seq`` of CP C over CP 1 (the same total work
split over C processes on this machine's cores, so on a CPU it says what the all-to-alls cost, not the speed-up).

    python bench/long_context.py [--seq 1024] [--batch 1] [--hidden 256] [--heads 8] [--layers 2]
                                 [--vocab 32000] [--tiles 8] [--cp 1,2,4] [--plot bench/results/long_context.png]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from activation_memory import SavedTensorCensus, _param_storages  # noqa: E402
from common import format_table  # noqa: E402

from models import GPT, GPTConfig  # noqa: E402
from models.parallel import get_parallel_state, initialize_model_parallel, model_parallel_seed  # noqa: E402


def _model(config_kw: dict, tiles: int) -> GPT:
    layout = get_parallel_state().layout.replace(tiled_mlp=tiles, tiled_loss=tiles)
    return GPT(GPTConfig(**config_kw), init_seed=0, layout=layout).to(torch.bfloat16).train()


def _batch(s: int, b: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _saved_bytes(model, s: int, b: int) -> int:
    ids, labels = _batch(s, b, model.config.vocab_size)
    with SavedTensorCensus(_param_storages(model)) as census:
        loss = model(ids, labels)
    loss.backward()  # the backward's all-to-alls pair with the other ranks'
    model.zero_grad(set_to_none=True)
    return census.bytes


def _seconds(model, s: int, b: int, rounds: int) -> float:
    ids, labels = _batch(s, b, model.config.vocab_size)
    times = []
    for r in range(rounds + 1):  # round 0 warms up
        torch.distributed.barrier()
        t0 = time.perf_counter()
        model(ids, labels).backward()
        torch.distributed.barrier()
        if r:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times) if times else float("nan")


def _rank(rank, cp, config_kw, s, b, tiles, lengths, rounds):
    initialize_model_parallel(context_parallel=cp)
    model_parallel_seed(1234)
    out = {}
    for t in (1, tiles):
        model = _model(config_kw, t)
        out[("bytes", t)] = {n: _saved_bytes(model, n, b) for n in lengths[t]}
        out[("seconds", t)] = _seconds(model, s, b, rounds) if rounds else float("nan")
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _longest(bytes_at: dict, s: int, budget: float) -> int:
    """The longest multiple of 128 whose census fits ``budget``, by the line through s and 2 s."""
    slope = (bytes_at[2 * s] - bytes_at[s]) / s
    base = bytes_at[s] - slope * s
    return int((budget - base) / slope) // 128 * 128


def _run_variant(run_distributed, variant: str, args) -> list[dict]:
    s, b = args.seq, args.batch
    config_kw = dict(variant=variant, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=args.heads, max_position_embeddings=128 * s, hidden_dropout=0.0, attention_dropout=0.0,
                     make_vocab_size_divisible_by=128)
    results = []
    budget = None
    for cp in map(int, args.cp.split(",")):
        r = run_distributed(_rank, cp, cp, config_kw, s, b, args.tiles, {1: [s, 2 * s], args.tiles: [s, 2 * s]},
                            args.rounds)[0]
        budget = budget or r[("bytes", 1)][s]  # CP 1 untiled at --seq
        for t in (1, args.tiles):
            longest = _longest(r[("bytes", t)], s, budget)
            check = run_distributed(_rank, cp, cp, config_kw, s, b, args.tiles, {1: [longest] if t == 1 else [],
                                    args.tiles: [longest] if t > 1 else []}, 0)[0][("bytes", t)][longest]
            results.append({"variant": variant, "cp": cp, "tiles": t, "bytes": r[("bytes", t)],
                            "longest": longest, "check_bytes": check, "budget": budget,
                            "seconds": r[("seconds", t)], "maxrss": r["maxrss"]})
    return results


def _tables(results: list[dict], s: int) -> tuple[list, list]:
    mib = 1 / 2**20
    one = {(r["variant"], r["tiles"]): r for r in results if r["cp"] == 1}
    rows, times = [], []
    for r in results:
        ref = one[(r["variant"], 1)]
        rows.append([r["variant"], f"CP{r['cp']}", "on" if r["tiles"] > 1 else "off", r["bytes"][s] * mib,
                     r["bytes"][2 * s] * mib, r["longest"], r["check_bytes"] * mib, r["budget"] * mib,
                     r["longest"] / ref["longest"], r["maxrss"] * mib])
        times.append([r["variant"], f"CP{r['cp']}", "on" if r["tiles"] > 1 else "off", r["seconds"],
                      r["seconds"] / one[(r["variant"], r["tiles"])]["seconds"]])
    return rows, times


def _plot(results: list[dict], s: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, variant in zip(axes, ("llama", "gpt2")):
        mine = [r for r in results if r["variant"] == variant]
        for r in mine:
            points = sorted({s: r["bytes"][s], 2 * s: r["bytes"][2 * s], r["longest"]: r["check_bytes"]}.items())
            ax.plot([x for x, _ in points], [y / 2**20 for _, y in points], "o-",
                    label=f"CP{r['cp']} tiling {'on' if r['tiles'] > 1 else 'off'}")
        ax.axhline(mine[0]["budget"] / 2**20, color="grey", ls="--", label=f"budget (CP1, untiled, s={s})")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{variant} bf16: activations saved per rank")
        ax.set_xlabel("sequence length")
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tiles", type=int, default=8, help="tiles of --tiled-mlp and --tiled-loss when on")
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of the step-time ratio")
    p.add_argument("--plot", default=str(common.ROOT / "bench" / "results" / "long_context.png"))
    p.add_argument("--json", default=str(common.ROOT / "bench" / "results" / "long_context.json"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(common.ROOT / "tests"))
    from dist import run_distributed  # the tests' launcher: N spawned gloo CPU ranks, results returned
    common.quiet_deepspeed()
    results = [r for variant in ("llama", "gpt2") for r in _run_variant(run_distributed, variant, args)]
    s = args.seq
    print(f"# activation bytes saved for the backward per rank (rank 0), bf16, b={args.batch} h={args.hidden} "
          f"a={args.heads} L={args.layers} V={args.vocab}, tiles {args.tiles}; {common.machine_note()}")
    rows, times = _tables(results, s)
    print(format_table(["model", "layout", "tiling", f"s={s} MiB", f"s={2 * s} MiB", "longest s in budget",
                        "measured there MiB", "budget MiB", "x CP1 untiled", "peak RSS MiB"], rows))
    print()
    print(format_table(["model", "layout", "tiling", f"step s at s={s}", "CP / CP1"], times))
    Path(args.json).write_text(json.dumps([{**r, "bytes": {str(k): v for k, v in r["bytes"].items()}}
                                           for r in results], indent=1))
    _plot(results, s, Path(args.plot))


if __name__ == "__main__":
    main()
