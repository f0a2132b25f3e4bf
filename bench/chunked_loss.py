"""The vocab-parallel cross-entropy's memory and time, whole against chunked (``chunk_tokens``), one process.

For [tokens, V] logits in bf16 (as a bf16 run's output layer gives them): what the loss keeps for its backward
(bytes saved by autograd, measured with ``torch.autograd.graph.saved_tensors_hooks``) and the time of forward +
backward, the systems interleaved round by round (medians); tests/models/test_chunked_cross_entropy.py checks that
no fp32 tensor larger than a chunk's is made. The whole loss makes an fp32 copy of the logits and keeps its softmax; the
chunked one keeps the bf16 logits and recomputes each chunk's softmax in the backward.

    python bench/chunked_loss.py [--tokens 8192] [--vocab 50304] [--chunks 0,1024,4096] [--rounds 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from common import format_table  # noqa: E402

from models.parallel import vocab_parallel_cross_entropy  # noqa: E402


def loss_step(logits: torch.Tensor, target: torch.Tensor, chunk: int | None) -> None:
    loss = vocab_parallel_cross_entropy(logits, target, chunk_tokens=chunk)
    loss.backward()


def saved_bytes(logits, target, chunk) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits, target, chunk_tokens=chunk)
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in saved}.values())
    loss.backward()
    return total


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50304, help="the logits' columns (V / TP of a TP run)")
    p.add_argument("--chunks", default="0,1024,4096", help="chunk sizes in tokens; 0: the whole loss")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    chunks = [int(c) or None for c in args.chunks.split(",")]
    times = {c: [] for c in chunks}
    for _ in range(args.rounds + 1):  # the first round warms up
        for c in chunks:
            logits.grad = None
            t0 = time.perf_counter()
            loss_step(logits, target, c)
            times[c].append(time.perf_counter() - t0)
    whole = statistics.median(times[None][1:]) if None in times else None
    rows = []
    for c in chunks:
        t = statistics.median(times[c][1:])
        rows.append({"chunk": c or "whole", "saved_mib": saved_bytes(logits, target, c) / 2**20,
                     "seconds": t,
                     "vs_whole": t / whole if whole else None})
    print(f"# {common.machine_note('cpu')}; bf16 logits [{args.tokens}, {args.vocab}]; {args.threads} thread(s); "
          f"median of {args.rounds} rounds")
    print(format_table(["chunk tokens", "saved for backward MiB", "fwd+bwd s", "x whole"],
                       [[r["chunk"], r["saved_mib"], r["seconds"],
                         "-" if r["vs_whole"] is None else f"{r['vs_whole']:.2f}"] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
