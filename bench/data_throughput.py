"""Data-flow benchmark: tokenize-and-pack throughput against the bare ``tokenizers`` batch encoder, and
peak memory while streaming a corpus at least 20x larger than the memory this benchmark allows itself.

    python bench/data_throughput.py                      # both parts, defaults below
    python bench/data_throughput.py --part throughput --num-proc 2
    python bench/data_throughput.py --part memory --rss-cap-mb 512 --stream-factor 20

Throughput (GPT-2 BPE, the shared English corpora): the baseline is ``tokenizers.Tokenizer.
encode_batch_fast`` over the same documents already split and in memory, batches of 1000 -- the practical
ceiling. Against it, in the same run and alternating (best of ``--repeats``): ``build_pretraining_data``
from the files (datasets text builder, held-out split, ``map`` tokenization written to the Arrow cache,
packing view) cold, then again with a warm cache, and the streaming flow read once. Tokens are counted
without the end-of-document ids we add.

Memory (byte tokenizer, the char-level mLSTM's streamed case): the corpus is the shared corpora copied
once to a temp dir and hard-linked until it is ``--stream-factor`` times ``--rss-cap-mb`` (every link is
read in full, so that many bytes are streamed; the page cache holds one copy, which is not our RSS). A
sampler thread watches the whole process RSS and aborts the run if it passes the cap. Prints RSS along
the stream, the peak, and the slope of RSS over the second half (MB per GB streamed; ~0 means flat),
and plots RSS against data streamed.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

import numpy as np  # noqa: E402
from tqdm import tqdm

from pipeline.data import DistributedBatchLoader, build_pretraining_data, load_tokenizer  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def anon_mb() -> float:
    """Anonymous resident memory (heap, buffers): what the data flow allocates. Unlike total RSS it does not
    move when the kernel drops file-backed pages (library code) under memory pressure from other processes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def documents(files) -> list[str]:
    """The documents the text builder makes of a .txt file: blank-line separated paragraphs."""
    docs = []
    for f in files:
        docs += [d for d in Path(f).read_text(encoding="utf-8").split("\n\n") if d]
    return docs


# --- throughput ---------------------------------------------------------------------------------------

def bare_encode(backend, docs, batch=1000) -> int:
    n = 0
    for i in range(0, len(docs), batch):
        n += sum(len(e.ids) for e in backend.encode_batch_fast(docs[i:i + batch], add_special_tokens=False))
    return n


def text_tokens(seqs, eod) -> int:
    """Tokens of a PackedSequences' stream, end-of-document ids left out."""
    return sum(int(len(c) - np.count_nonzero(c == eod)) for c in seqs._chunks)


def throughput(args):
    files = sorted(str(p) for p in Path(args.corpora).glob("*.txt"))
    if not files:
        sys.exit(f"no *.txt corpora in {args.corpora}")
    tok = load_tokenizer(args.tokenizer)  # a fresh one per measurement below: BPE caches words it has seen
    docs = documents(files)
    size = sum(os.path.getsize(f) for f in files) / 2**20
    print(f"\n== tokenize-and-pack throughput: {tok.name} (vocab {tok.vocab_size}), seq_length {args.seq_length}, "
          f"num_proc {args.num_proc}, TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}, "
          f"{os.cpu_count()} CPUs")
    print(f"   corpora: {', '.join(Path(f).name for f in files)} ({size:.1f} MiB, {len(docs):,} documents)")
    best: dict[str, tuple[float, int]] = {}

    def record(name, seconds, tokens):
        if name not in best or seconds < best[name][0]:
            best[name] = (seconds, tokens)

    for rep in range(args.repeats):
        backend = load_tokenizer(args.tokenizer).backend
        start = time.perf_counter()
        n = bare_encode(backend, docs)
        record("bare", time.perf_counter() - start, n)

        cache = tempfile.mkdtemp(prefix="bench-cache-")
        try:
            kw = dict(valid_fraction=0.01, num_proc=args.num_proc, cache_dir=cache)
            fresh = load_tokenizer(args.tokenizer)
            start = time.perf_counter()
            train, valid = build_pretraining_data(files, fresh, args.seq_length, **kw)
            record("map_cold", time.perf_counter() - start, text_tokens(train, tok.eod_id) + text_tokens(valid, tok.eod_id))
            start = time.perf_counter()
            train, valid = build_pretraining_data(files, fresh, args.seq_length, **kw)
            record("map_warm", time.perf_counter() - start, text_tokens(train, tok.eod_id) + text_tokens(valid, tok.eod_id))
            del train, valid
        finally:
            shutil.rmtree(cache, ignore_errors=True)

        fresh = load_tokenizer(args.tokenizer)
        start = time.perf_counter()
        stream, held_out = build_pretraining_data(files, fresh, args.seq_length, valid_fraction=0.01, streaming=True)
        n = 0
        for part in (stream, held_out):
            for seq in part:  # sequences share one token with the next; count each token once
                n += int(args.seq_length - (seq[1:] == tok.eod_id).sum())
        record("stream", time.perf_counter() - start, n)
        print(f"   repeat {rep + 1}/{args.repeats} done", flush=True)

    base = best["bare"][1] / best["bare"][0]
    rows = [("bare", "bare tokenizers encode_batch_fast (ceiling)"),
            ("map_cold", "build_pretraining_data, map-style, cold cache"),
            ("map_warm", "same, warm cache (reads the Arrow cache only)"),
            ("stream", "build_pretraining_data, streaming, one pass")]
    print(f"   {'':48s} {'tokens':>12s} {'seconds':>8s} {'tokens/s':>12s} {'ratio':>7s}")
    for key, label in rows:
        seconds, tokens = best[key]
        rate = tokens / seconds
        print(f"   {label:48s} {tokens:12,d} {seconds:8.2f} {rate:12,.0f} {rate / base:7.2f}")
    return best


# --- streaming memory ---------------------------------------------------------------------------------

class RssWatch(threading.Thread):
    """Samples the process RSS; flags the run when it passes ``cap_mb``."""

    def __init__(self, cap_mb, every=0.02):
        super().__init__(daemon=True)
        self.cap_mb, self.every = cap_mb, every
        self.peak, self.peak_anon, self.exceeded, self._halt = 0.0, 0.0, None, threading.Event()

    def run(self):
        while not self._halt.is_set():
            rss = rss_mb()
            self.peak = max(self.peak, rss)
            self.peak_anon = max(self.peak_anon, anon_mb())
            if rss > self.cap_mb and self.exceeded is None:
                self.exceeded = rss
            time.sleep(self.every)

    def stop(self):
        self._halt.set()
        self.join()


def memory(args):
    tok = load_tokenizer("bytes")
    sources = sorted(Path(args.corpora).glob("*.txt"))
    target = int(args.stream_factor * args.rss_cap_mb * 2**20)
    workdir = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        originals = []
        for src in sources:  # one real copy on this file system, then hard links to it
            dst = workdir / f"orig-{src.name}"
            shutil.copyfile(src, dst)
            originals.append(dst)
        total, k = 0, 0
        while total < target:
            src = originals[k % len(originals)]
            os.link(src, workdir / f"part{k:05d}.txt")
            total += src.stat().st_size
            k += 1
        for src in originals:
            src.unlink()  # the links keep the data; the glob below sees only the parts
        print(f"\n== streaming memory: byte tokenizer, {k} files = {total / 2**30:.2f} GiB of real text "
              f"(shared corpora repeated), RSS cap {args.rss_cap_mb} MiB -> corpus / cap = "
              f"{total / 2**20 / args.rss_cap_mb:.1f}x")
        train, _ = build_pretraining_data(str(workdir / "part*.txt"), tok, args.seq_length, streaming=True,
                                          valid_fraction=0.01)
        loader = DistributedBatchLoader(train, args.micro_batch, 0, 1)
        baseline, baseline_anon = rss_mb(), anon_mb()
        setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        watch = RssWatch(args.rss_cap_mb)
        watch.start()
        points, streamed, next_mark = [(0.0, baseline)], 0, 0
        maxrss, anon = [setup_peak], [baseline_anon]  # the kernel's high-water mark at each point: catches spikes between samples
        per_batch = args.micro_batch * args.seq_length
        start = time.perf_counter()
        with tqdm(total=total, unit="B", unit_scale=True, desc="streaming", mininterval=2) as bar:
            while loader.epoch == 0:
                next(loader)
                streamed += per_batch
                bar.update(per_batch)
                if streamed >= next_mark:
                    points.append((streamed / 2**30, rss_mb()))
                    anon.append(anon_mb())
                    maxrss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                    next_mark += total // 200
                if watch.exceeded is not None:
                    raise SystemExit(f"RSS {watch.exceeded:.0f} MiB passed the cap of {args.rss_cap_mb} MiB "
                                     f"after {streamed / 2**30:.2f} GiB")
        seconds = time.perf_counter() - start
        watch.stop()
        points.append((streamed / 2**30, rss_mb()))
        anon.append(anon_mb())
        gb = np.array([p[0] for p in points])
        rss = np.array([p[1] for p in points])
        anon = np.array(anon)
        half = gb >= gb[-1] / 2
        slope = np.polyfit(gb[half], rss[half], 1)[0] if half.sum() > 2 else float("nan")
        slope_anon = np.polyfit(gb[half], anon[half], 1)[0] if half.sum() > 2 else float("nan")
        maxrss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        marks = [int(round(f * (len(points) - 1))) for f in np.linspace(0.1, 1.0, 10)]
        jumps = [(points[i][0], maxrss[i]) for i in range(1, len(maxrss)) if maxrss[i] > maxrss[i - 1] + 8]
        print(f"   streamed {streamed / 2**30:.2f} GiB in {seconds:.0f} s ({streamed / seconds / 1e6:.1f} M tokens/s)")
        print(f"   RSS: {baseline:.0f} MiB before streaming (set-up peak {setup_peak:.0f}); sampled peak "
              f"{watch.peak:.0f} MiB (every 20 ms); kernel high-water mark (ru_maxrss) {maxrss_end:.0f} MiB; "
              f"cap {args.rss_cap_mb} MiB")
        print("   RSS along the stream: " + ", ".join(f"{gb[i]:.2f} GiB: {rss[i]:.0f}" for i in marks) + " (MiB)")
        print(f"   anonymous RSS (heap, buffers): {baseline_anon:.0f} MiB before, sampled peak {watch.peak_anon:.0f} MiB; "
              "along the stream: " + ", ".join(f"{anon[i]:.0f}" for i in marks) + " (MiB)")
        print("   ru_maxrss rose (by > 8 MiB) at: " + (", ".join(f"{g:.2f} GiB -> {m:.0f}" for g, m in jumps) or "never"))
        print(f"   slope over the second half: RSS {slope:+.2f}, anonymous {slope_anon:+.2f} MiB per GiB streamed; "
              f"corpus / RSS high-water mark = {total / 2**20 / maxrss_end:.1f}x")
        if args.plot:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(gb, rss, label="process RSS")
            ax.plot(gb, anon, label="anonymous RSS")
            ax.axhline(args.rss_cap_mb, color="r", linestyle="--", label=f"cap {args.rss_cap_mb} MiB")
            ax.set(xlabel="GiB streamed (byte tokens)", ylabel="RSS (MiB)", ylim=(0, args.rss_cap_mb * 1.1),
                   title=f"Streaming {total / 2**30:.1f} GiB: memory stays flat")
            ax.legend()
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.plot, dpi=120, bbox_inches="tight")
            print(f"   plot: {args.plot}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "throughput", "memory"], default="all")
    parser.add_argument("--corpora", default=str(SHARED / "corpora"))
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "gpt2"))
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--num-proc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rss-cap-mb", type=int, default=512, help="whole-process RSS the memory part allows itself")
    parser.add_argument("--stream-factor", type=float, default=20.0, help="corpus size as a multiple of the cap")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--plot", default=str(ROOT / "out" / "data_streaming_rss.png"))
    args = parser.parse_args()
    if args.part in ("all", "throughput"):
        throughput(args)
    if args.part == "memory":
        memory(args)
    elif args.part == "all":  # a fresh interpreter, so the throughput part's memory is not counted
        import subprocess
        argv = [a for a in sys.argv[1:] if a not in ("--part", "all")]
        subprocess.run([sys.executable, __file__, *argv, "--part", "memory"], check=True)


if __name__ == "__main__":
    main()
