"""Large-batch convergence study for the mLSTM (Puri et al. 2018, "Converging on 40GB of text in four hours").

The same tiny byte-level mLSTM is trained on the same number of characters at a small global
batch and at a 16x larger one, each with a constant learning rate and with the large-batch
schedule (learning rate scaled with the batch up to a cap, linear warmup, then linear decay to
zero). Training is truncated BPTT over contiguous streams with the state carried between
chunks, as in the paper. Held-out bits per character are measured along the way on text the
models never saw; the final figures and a plot of the curves are written to --out.

    python bench/mlstm_large_batch.py                       # ~a few minutes on 2 CPU cores
    python bench/mlstm_large_batch.py --tokens 4000000 --hidden 256

A plain PyTorch loop (no DeepSpeed): this measures the recipe, not the engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import matplotlib
import matplotlib.pyplot as plt
from tqdm import tqdm

from models.mlstm import MLSTM, MLSTMConfig, save_mlstm  # noqa: E402
from pipeline.evaluation.metrics_lm import stream_bpc  # noqa: E402


def load_text(path: Path, heldout_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = path.read_bytes()
    if len(data) < 4 * heldout_bytes:
        raise SystemExit(f"{path} has {len(data)} bytes: too small for {heldout_bytes} held-out bytes")
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return ids[:-heldout_bytes], ids[-heldout_bytes:]       # held-out: the end of the file, never trained on


def make_streams(ids: torch.Tensor, batch: int, chars_per_stream: int) -> torch.Tensor:
    n = (ids.numel() - 1) // batch
    if n < chars_per_stream + 1:
        raise SystemExit(f"training text too short: {batch} streams x {chars_per_stream + 1} chars needed, "
                         f"{ids.numel()} available")
    return torch.stack([ids[j * n:j * n + chars_per_stream + 1] for j in range(batch)])


def lr_factor(step: int, total: int, warmup: int, schedule: bool) -> float:
    if not schedule:
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def train_run(name, args, train_ids, eval_ids, batch, schedule) -> dict:
    torch.manual_seed(args.seed)
    config = MLSTMConfig(vocab_size=257, embed_dim=args.embed, hidden_size=args.hidden, seq_length=args.bptt)
    model = MLSTM(config)
    model.carry_state = True
    scale = batch / args.small_batch
    lr = min(args.lr * scale, args.lr_cap) if schedule else args.lr
    steps = args.tokens // (batch * args.bptt)
    warmup = max(1, int(args.warmup * steps))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup, schedule))
    streams = make_streams(train_ids, batch, steps * args.bptt)
    eval_every = max(1, steps // args.points)
    curve = [(0, stream_bpc(model, eval_ids[:args.curve_bytes], args.eval_batch, args.bptt)["bpc"])]
    t0 = time.time()
    for step in tqdm(range(steps), desc=name, unit="step", leave=False):
        k = step * args.bptt
        loss = model(streams[:, k:k + args.bptt], labels=streams[:, k + 1:k + args.bptt + 1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            print(f"{name}: loss diverged at step {step}", flush=True)
            break
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append(((step + 1) * batch * args.bptt,
                          stream_bpc(model, eval_ids[:args.curve_bytes], args.eval_batch, args.bptt)["bpc"]))
    train_seconds = time.time() - t0
    final = stream_bpc(model, eval_ids, args.eval_batch, args.bptt)
    return {"name": name, "batch": batch, "schedule": schedule, "peak_lr": lr, "steps": steps, "warmup_steps":
            warmup if schedule else 0, "tokens": steps * batch * args.bptt, "final_bpc": final["bpc"],
            "heldout_chars": final["chars"], "curve": curve, "train_seconds": round(train_seconds, 1),
            "model": model}


def plot(runs, path: Path, args) -> None:
    matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        xs, ys = zip(*r["curve"])
        ax.plot([x / 1e6 for x in xs], ys, marker="o", markersize=3, label=f"{r['name']} (final {r['final_bpc']:.3f})",
                linestyle="-" if r["schedule"] else "--")
    ax.set_xlabel("training characters (millions)")
    ax.set_ylabel(f"held-out bits per character ({args.curve_bytes // 1000} KB)")
    ax.set_title(f"mLSTM H={args.hidden}: batch {args.small_batch} vs {args.small_batch * args.factor}, "
                 f"same {args.tokens / 1e6:g}M characters")
    ax.set_ylim(top=min(8.1, max(y for r in runs for _, y in r["curve"][1:]) + 0.3))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "corpora" / "wikipedia.txt"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "mlstm_large_batch"))
    ap.add_argument("--tokens", type=int, default=1_000_000, help="training characters per run")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--bptt", type=int, default=64)
    ap.add_argument("--small-batch", type=int, default=8)
    ap.add_argument("--factor", type=int, default=16, help="large batch = factor x small batch")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate at the small batch")
    ap.add_argument("--lr-cap", type=float, default=1e-2, help="cap of the batch-scaled learning rate")
    ap.add_argument("--warmup", type=float, default=0.1, help="warmup, as a fraction of the run's steps")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--heldout-bytes", type=int, default=200_000)
    ap.add_argument("--curve-bytes", type=int, default=40_000, help="held-out bytes for the curve points")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--points", type=int, default=8, help="curve points per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="small-const,small-sched,large-const,large-sched",
                    help="which runs, comma-separated from small-const, small-sched, large-const, large-sched")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_ids, eval_ids = load_text(Path(args.text), args.heldout_bytes)
    large = args.small_batch * args.factor
    plan = {"small-const": (f"B={args.small_batch} constant LR", args.small_batch, False),
            "small-sched": (f"B={args.small_batch} warmup+decay", args.small_batch, True),
            "large-const": (f"B={large} constant LR", large, False),
            "large-sched": (f"B={large} scaled LR+warmup+decay", large, True)}
    unknown = set(args.runs.split(",")) - set(plan)
    if unknown:
        raise SystemExit(f"--runs: unknown run(s) {', '.join(sorted(unknown))}; choose from {', '.join(plan)}")
    plan = [plan[k] for k in args.runs.split(",")]
    print(f"{Path(args.text).name}: {train_ids.numel()} training bytes, {eval_ids.numel()} held-out; "
          f"{args.tokens / 1e6:g}M characters per run; mLSTM H={args.hidden} E={args.embed} bptt={args.bptt}")
    runs = []
    for name, batch, schedule in plan:
        r = train_run(name, args, train_ids, eval_ids, batch, schedule)
        runs.append(r)
        print(f"{name:<34} steps {r['steps']:>5}  peak lr {r['peak_lr']:.2e}  held-out BPC {r['final_bpc']:.4f}  "
              f"({r['train_seconds']:.0f}s)", flush=True)
    best = min(runs, key=lambda r: r["final_bpc"])
    save_mlstm(best["model"], out / "best_model")
    plot(runs, out / "curves.png", args)
    results = {"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "model"} for r in runs],
               "best": best["name"], "best_model_dir": str(out / "best_model")}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'results.json'}, {out / 'curves.png'}; best model ({best['name']}) in {out / 'best_model'}")


if __name__ == "__main__":
    main()
