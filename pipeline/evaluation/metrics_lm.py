"""Language-model metrics shared by evaluation, benchmarks and tests: bits per character.

For byte-level models a "character" is a byte (the same for ASCII text), as in the mLSTM papers.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

LN2 = math.log(2.0)


def bits_per_char(nll_nats: float | torch.Tensor, num_chars: int | None = None) -> float:
    """Bits per character from a cross-entropy in nats.

    ``num_chars`` None: ``nll_nats`` is already a mean per character; otherwise it is the
    sum over ``num_chars`` characters.
    """
    total = float(nll_nats.detach()) if isinstance(nll_nats, torch.Tensor) else float(nll_nats)
    if num_chars is not None:
        if num_chars < 1:
            raise ValueError(f"num_chars must be positive, got {num_chars}")
        total /= num_chars
    return total / LN2


@torch.no_grad()
def stream_bpc(model, ids: torch.Tensor, batch_size: int = 16, seq_length: int = 256, progress: bool = False) -> dict:
    """Bits per character of a recurrent LM on one long text, read the way it trains.

    The text (1-D token ids) is cut into ``batch_size`` contiguous streams read ``seq_length``
    characters at a time, the state carried across chunks from zero at the start. Every
    character but the first of each stream is scored once. ``model(ids, state=state)`` must
    return ``(logits [b, s, V], new_state)`` (the MLSTM interface); a model in carry-state mode
    is evaluated in an isolated state, so a training stream's carried state is left untouched.
    Returns {"bpc", "nll_nats" (mean), "chars"}.
    """
    ids = torch.as_tensor(ids).view(-1)
    n = (ids.numel() - 1) // batch_size
    if n < 1:
        raise ValueError(f"text of {ids.numel()} tokens is too short for {batch_size} streams")
    device = next(model.parameters()).device
    streams = torch.stack([ids[j * n:(j + 1) * n + 1] for j in range(batch_size)]).to(device)
    was_training = model.training
    model.eval()
    isolated = model.isolated_state() if hasattr(model, "isolated_state") else contextlib.nullcontext()
    total, state = 0.0, None
    chunks = range(0, n, seq_length)
    if progress:
        chunks = tqdm(chunks, desc="bpc", unit="chunk")
    try:
        with isolated:
            for k in chunks:
                x, y = streams[:, k:min(k + seq_length, n)], streams[:, k + 1:min(k + seq_length, n) + 1]
                logits, state = model(x, state=state)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
    finally:
        model.train(was_training)
    chars = n * batch_size
    return {"bpc": bits_per_char(total, chars), "nll_nats": total / chars, "chars": chars}
