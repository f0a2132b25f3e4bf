"""What ``python -m pipeline.generate`` does with its arguments: the prompts (refused before the model loads when
bad), the model at ``--tensor-parallel`` ranks, batches of left-padded prompts decoded together, the tokens of a
single prompt streamed to the terminal, and the JSON lines written atomically on rank 0."""
from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from pipeline.engine.distributed import init_distributed
from pipeline.generation.decode import Generation, generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.loading import load_generation_model
from pipeline.generation.prompts import encode_prompts, read_prompts
from pipeline.generation.sampling import SampleSettings
from pipeline.job.arguments import add_sampling_args  # noqa: F401 (re-exported)
from pipeline.job.errors import InputError
from pipeline.job.files import atomic_write_text, check_output_file, refuse_overlap


def settings_from_args(args, greedy: bool | None = None) -> SampleSettings:
    return SampleSettings(max_new_tokens=args.max_new_tokens, greedy=args.greedy if greedy is None else greedy,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed).check()


def completion_text(tokenizer, g: Generation) -> str:
    return tokenizer.tokenizer.decode(g.new_ids, skip_special_tokens=True)


class Streamer:
    """Prints a row's new text as it grows (the tokens of a single prompt, on rank 0); a character whose bytes
    have not all come yet (a trailing replacement character) waits for them, or for ``finish``."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.shown, self.text = tokenizer, out, "", ""

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def __call__(self, row: int, new_ids: list[int]) -> None:
        self.text = self.tokenizer.tokenizer.decode(new_ids, skip_special_tokens=True)
        self._show(self.text.rstrip("\ufffd"))

    def finish(self) -> None:
        self._show(self.text)
        self.out.write("\n")
        self.out.flush()


def check_args(args) -> None:
    if (args.prompt is None) == (args.prompts is None):
        raise InputError("give one of --prompt TEXT or --prompts FILE")
    if args.tensor_parallel < 1 or args.batch_size < 1:
        raise InputError(f"--tensor-parallel ({args.tensor_parallel}) and --batch-size ({args.batch_size}) "
                         f"must be >= 1")
    if args.out is not None:
        refuse_overlap(args.out, [("--checkpoint", args.checkpoint), ("--hf", args.hf), ("--prompts", args.prompts)])
        check_output_file(args.out, args.force)


def run_generation(args) -> list[dict]:
    """Every rank runs it (the TP group decodes together); rank 0 writes ``args.out``."""
    check_args(args)
    settings = settings_from_args(args)
    prompts = read_prompts(args.prompt, args.prompts)
    init_distributed()
    model, tokenizer = load_generation_model(checkpoint=args.checkpoint, hf=args.hf, tokenizer=args.tokenizer,
                                             tensor_parallel=args.tensor_parallel, dtype=args.dtype)
    decoder = decoder_for(model, use_cache=not args.no_cache)
    ids = encode_prompts(tokenizer, prompts, decoder.max_positions, "--prompts" if args.prompts else "--prompt")
    is_main = dist.get_rank() == 0
    hf_tok = tokenizer.tokenizer
    eos = hf_tok.eos_token_id
    pad = next((t for t in (hf_tok.pad_token_id, eos, 0) if t is not None))
    # without --out, stdout carries the JSON lines only: the streamed text goes to stderr
    stream_to = sys.stdout if args.out is not None else sys.stderr
    stream = Streamer(tokenizer, stream_to) if len(ids) == 1 and is_main and not args.quiet else None
    start, results = time.perf_counter(), []
    for first in range(0, len(ids), args.batch_size):
        results += generate(decoder, ids[first:first + args.batch_size], settings, eos_id=eos, pad_id=pad,
                            on_token=stream, progress=is_main and stream is None and not args.quiet)
    elapsed = time.perf_counter() - start
    if stream is not None:
        stream.finish()
    records = [{"index": i, "prompt": text, "completion": completion_text(tokenizer, g), "prompt_ids": g.prompt_ids,
                "new_ids": g.new_ids, "finish_reason": g.finish_reason, "settings": settings.to_dict()}
               for i, (text, g) in enumerate(zip(prompts, results))]
    if is_main:
        lines = "".join(json.dumps(r) + "\n" for r in records)
        if args.out is None:
            sys.stdout.write(lines)
            sys.stdout.flush()
        else:
            atomic_write_text(args.out, lines)
        new = sum(len(g.new_ids) for g in results)
        print(f"generate: {len(records)} prompts, {new} new tokens in {elapsed:.1f}s "
              f"({new / max(elapsed, 1e-9):.1f} tokens/s) -> {args.out or 'stdout'}", file=sys.stderr)
    return records
