"""The decoding loop: left-padded prompts in one batch, a token per row per step until each row stops at the
end-of-text token, ``max_new_tokens`` or the model's last position. Every rank of a tensor-parallel group runs it
with the same inputs and the same seed, and gets the same tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pipeline.generation.sampling import SampleSettings, next_tokens


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    finish_reason: str  # "eos", "length" (max_new_tokens) or "context" (the model's last position)


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, width], mask [b, width] True for real tokens), each row's tokens at its right end."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = True
    return ids.to(device), mask.to(device)


def generate(decoder, prompts: list[list[int]], settings: SampleSettings, *, eos_id: int | None = None,
             pad_id: int = 0, on_token: Callable[[int, list[int]], None] | None = None,
             progress: bool = False) -> list[Generation]:
    """Continue each prompt (token ids, none empty). ``on_token(row, new_ids)`` after every step of a live row
    (for streaming); the sampling generator is ``torch.Generator().manual_seed(settings.seed)``, never the
    global RNG."""
    generator = None if settings.greedy else torch.Generator().manual_seed(settings.seed)
    limit = decoder.max_positions
    out = [Generation(list(p), [], "length") for p in prompts]
    alive = torch.ones(len(prompts), dtype=torch.bool)
    ids, mask = left_padded(prompts, pad_id, decoder.device)
    logits = decoder.start(ids, mask)
    for step in tqdm(range(settings.max_new_tokens), desc="generate", unit="token", disable=not progress,
                     dynamic_ncols=True):
        tokens = next_tokens(logits, settings, generator)
        for row, token in enumerate(tokens.tolist()):
            if not alive[row]:
                continue
            g = out[row]
            g.new_ids.append(token)
            if on_token is not None:
                on_token(row, g.new_ids)
            if eos_id is not None and token == eos_id:
                g.finish_reason, alive[row] = "eos", False
            elif limit is not None and len(g.prompt_ids) + len(g.new_ids) >= limit:
                g.finish_reason, alive[row] = "context", False
        if not alive.any() or step == settings.max_new_tokens - 1:
            break
        logits = decoder.next(tokens.to(decoder.device), alive.to(decoder.device))
    return out
