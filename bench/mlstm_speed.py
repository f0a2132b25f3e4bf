"""Training throughput of the mLSTM against torch.nn.LSTM of the same hidden size, side by side.

Both models are byte LMs of the same shape: a 64-d embedding, one recurrent layer of
``--hidden`` units, a linear output layer over 257 ids, mean cross-entropy, an Adam step.
One timed step = forward + backward + optimizer step on [batch, seq] tokens. Steps of the two
models alternate, so a busy machine slows both alike; the ratio is taken per pair of
steps and its median reported. The mLSTM does 5/4 of the LSTM's recurrent arithmetic
(two recurrent matmuls, 5H^2 weights against 4H^2), so ~1.25x is the floor; the goal is <= 1.5x.

    python bench/mlstm_speed.py                                  # H 512,1024; fp32 and bf16
    python bench/mlstm_speed.py --hidden 4096 --batch 128 --seq 256   # the paper's size (GPU)
    python bench/mlstm_speed.py --profile                        # top ops of one mLSTM step

``bf16`` casts both models' weights to bf16 (as DeepSpeed's bf16 mode does); ``bf16-autocast``
keeps fp32 weights under torch.autocast.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.mlstm import MLSTM, MLSTMConfig  # noqa: E402

VOCAB, EMBED = 257, 64


class LSTMLM(nn.Module):
    """The baseline: the same LM around torch.nn.LSTM (cuDNN on GPU, oneDNN on CPU)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBED)
        self.rnn = nn.LSTM(EMBED, hidden)
        self.lm_head = nn.Linear(hidden, VOCAB)

    def forward(self, x, y):
        out, _ = self.rnn(self.embedding(x.t()))
        return F.cross_entropy(self.lm_head(out).float().view(-1, VOCAB), y.t().reshape(-1))


class MLSTMLM(nn.Module):
    def __init__(self, hidden: int, weight_norm: str):
        super().__init__()
        self.model = MLSTM(MLSTMConfig(vocab_size=VOCAB, embed_dim=EMBED, hidden_size=hidden, weight_norm=weight_norm))

    def forward(self, x, y):
        return self.model(x, labels=y)[0]


def make_step(model, x, y, autocast_dtype, device):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    amp = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext

    def step():
        with amp():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def timed(step, device, clock=time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = clock()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t


def compare(hidden, batch, seq, precision, iters, warmup, device, weight_norm, profile=False, clock=time.perf_counter) -> dict:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (batch, seq), device=device)
    y = torch.randint(0, 256, (batch, seq), device=device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast_dtype = torch.bfloat16 if precision == "bf16-autocast" else None
    models = {"mlstm": MLSTMLM(hidden, weight_norm), "lstm": LSTMLM(hidden)}
    steps = {k: make_step(m.to(device=device, dtype=dtype), x, y, autocast_dtype, device) for k, m in models.items()}
    for _ in range(warmup):
        for s in steps.values():
            timed(s, device)
    times = {k: [] for k in steps}
    for _ in range(iters):
        for k, s in steps.items():
            times[k].append(timed(s, device, clock))
    if profile:
        from torch.profiler import profile as torch_profile
        with torch_profile(record_shapes=True) as prof:
            steps["mlstm"]()
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20,
                                                                 max_name_column_width=32, max_shapes_column_width=60))
    ratios = [a / b for a, b in zip(times["mlstm"], times["lstm"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(hidden=hidden, batch=batch, seq=seq, precision=precision, weight_norm=weight_norm,
                mlstm_ms=1e3 * med["mlstm"], lstm_ms=1e3 * med["lstm"],
                mlstm_chars_per_s=batch * seq / med["mlstm"], lstm_chars_per_s=batch * seq / med["lstm"],
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="512,1024", help="comma-separated hidden sizes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16, bf16-autocast")
    ap.add_argument("--weight-norm", default="all", choices=["all", "recurrent", "none"])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (robust on a shared CPU machine with --threads 1)")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one mLSTM step")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device} threads {torch.get_num_threads()} batch {args.batch} seq {args.seq} "
          f"weight_norm {args.weight_norm} clock {args.clock}; median of {args.iters} alternating steps (fwd+bwd+Adam)")
    print(f"{'hidden':>6} {'precision':>13} {'mLSTM ms':>9} {'LSTM ms':>9} {'mLSTM ch/s':>11} {'LSTM ch/s':>10} "
          f"{'ratio':>6} {'(min-max)':>12}")
    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        for precision in args.precision.split(","):
            r = compare(hidden, args.batch, args.seq, precision, args.iters, args.warmup, device, args.weight_norm,
                        args.profile, time.perf_counter if args.clock == "wall" else time.process_time)
            rows.append(r)
            print(f"{hidden:>6} {precision:>13} {r['mlstm_ms']:>9.1f} {r['lstm_ms']:>9.1f} "
                  f"{r['mlstm_chars_per_s']:>11.0f} {r['lstm_chars_per_s']:>10.0f} {r['ratio']:>6.2f} "
                  f"{r['ratio_min']:>5.2f}-{r['ratio_max']:.2f}", flush=True)
    print("ratio = mLSTM step time / LSTM step time (goal <= 1.5; 1.25 is the arithmetic floor)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
