"""Samples during SFT (``--sample-interval N --sample-prompts FILE``), as pretraining writes them
(``pipeline.generation.training``): each prompt is a user message rendered by the chat template with the
generation prompt, continued greedily and sampled until the end-of-turn token; SAVE/samples.jsonl and DeepSpeed's
monitor get the replies. With LoRA the adapters answer (they are on the linears the decoder runs)."""
from __future__ import annotations

from pathlib import Path

from pipeline.generation.training import sample_hooks


class ChatPrompts:
    """A chat tokenizer as the samples read a run's tokenizer: ``encode`` renders a user message for a reply,
    ``eod_id`` ends the reply (the tokenizer's end of sequence: the chat's end-of-turn token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eod_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def chat_sample_hooks(args, engine, base, job) -> list:
    """The loop hook that writes replies to --sample-prompts (none without --sample-interval)."""
    return sample_hooks(args, engine, base.config, ChatPrompts(base.tokenizer), job,
                        Path(args.save) if args.save else None)
