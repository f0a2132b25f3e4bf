"""Generation speed: tokens/s of the project's decoding (pipeline.generation) with and without its KV cache, against
``transformers``' ``generate`` on the same model exported by pipeline/hf/export.py, side by side (CPU).

A random GPT of a CPU size (bench/common.py's ``small``: hidden 256, 4 layers, vocabulary 8192) is built, exported
and loaded back by transformers (SDPA attention); each system continues the same batch of prompts greedily for
``--new-tokens`` tokens (no end-of-text stop, so every system produces the same number of tokens). One timed call
= one whole generation; the systems alternate round by round (bench/common.py's ``interleaved``), timed in process
CPU time with one torch thread. The fp32 row also checks that the four systems produce the same tokens.

    python bench/generate.py                                  # gpt2 and llama, fp32 and bf16
    python bench/generate.py --variants llama --batch 1 --prompt-tokens 16 --new-tokens 128 --json r.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import common  # bench/common.py: puts the project on the path first
import torch
from transformers import AutoModelForCausalLM

from models import GPT
from models.parallel import full_state_dict, initialize_model_parallel
from pipeline.generation.decode import generate
from pipeline.generation.decoders import GPTDecoder
from pipeline.generation.sampling import SampleSettings
from pipeline.hf.export import export_hf

SYSTEMS = ("ours-cache", "ours-no-cache", "hf-cache", "hf-no-cache")


def build(variant: str, size: str, work: Path):
    """(project GPT, transformers model of its export)."""
    config = common.model_config(common.CPU_SIZES[size], variant)
    model = GPT(config, init_seed=0).eval()
    hf_dir = export_hf(config, full_state_dict(model), work / f"{variant}-{size}", force=True)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    return model, hf


def systems(model, hf, prompts: torch.Tensor, new_tokens: int) -> list[common.System]:
    rows = prompts.tolist()
    settings = SampleSettings(new_tokens)

    def ours(cache: bool):
        return lambda: [g.new_ids for g in generate(GPTDecoder(model, cache), rows, settings)]

    def theirs(cache: bool):
        def run():
            with torch.no_grad():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=cache,
                                  pad_token_id=0)
            return out[:, prompts.shape[1]:].tolist()
        return run
    steps = {"ours-cache": ours(True), "ours-no-cache": ours(False), "hf-cache": theirs(True),
             "hf-no-cache": theirs(False)}
    return [common.System(name, steps[name]) for name in SYSTEMS]


def measure(variant: str, size: str, precision: str, args, work: Path) -> list[dict]:
    model, hf = build(variant, size, work)
    dtype = common.DTYPES[precision]
    model.to(dtype)
    hf.to(dtype)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_tokens), generator=g)
    contenders = systems(model, hf, prompts, args.new_tokens)
    common.interleaved(contenders, args.rounds, warmup=1, progress=f"{variant} {precision}", clock=args.clock)
    same = len({json.dumps(s.results[-1]) for s in contenders}) == 1
    base = next(s for s in contenders if s.name == "hf-cache")
    return [{"variant": variant, "size": size, "precision": precision, "system": s.name,
             "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
             "tokens_per_s": args.batch * args.new_tokens / common.median(s.times),
             "vs_hf_cache": common.paired_ratio(base.times, s.times), "same_tokens": same} for s in contenders]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="gpt2,llama")
    p.add_argument("--size", default="small", help=f"of {', '.join(common.CPU_SIZES)}")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default=None, help="default: cpu with one thread, else wall")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    initialize_model_parallel(1)
    rows = []
    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        for variant in args.variants.split(","):
            for precision in args.precisions.split(","):
                rows += measure(variant, args.size, precision, args, Path(work))
    print(common.format_table(["variant", "precision", "system", "tokens/s", "vs hf-cache", "same tokens"],
                              [[r["variant"], r["precision"], r["system"], r["tokens_per_s"], r["vs_hf_cache"],
                                r["same_tokens"]] for r in rows]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
