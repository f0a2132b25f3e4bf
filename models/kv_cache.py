"""The keys and values a GPT has read, for decoding one token at a time (``GPT.parallel_logits(ids, cache)``).

Rows may be left-padded: ``read(mask)`` takes the [b, s] mask of the tokens about to be read (True for a
real token, False for padding) before each forward. A token's position counts the real tokens before it
(as Hugging Face's ``generate`` derives ``position_ids`` from the attention mask), so a left-padded row is
decoded as it would be alone. Each layer's attention keeps this rank's heads: [b, local_kv_heads, t, d].
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.mask: torch.Tensor | None = None        # [b, t] every token read so far (True: real)
        self.positions: torch.Tensor | None = None   # [b, s] positions of the tokens being read
        self.attn_mask: torch.Tensor | None = None   # [b, 1, s, t] which keys each new query sees, or None:
        self.is_causal = False                       # no padding read: all keys (s = 1), or causal (s = t)

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def read(self, new_mask: torch.Tensor) -> None:
        """Before a forward over ``s`` new tokens: their mask [b, s] (True for real tokens)."""
        new_mask = new_mask.bool()
        self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)
        s, t = new_mask.shape[1], self.mask.shape[1]
        self.positions = (self.mask.long().cumsum(-1) - 1).clamp(min=0)[:, t - s:]
        if (s == 1 or s == t) and bool(self.mask.all()):  # SDPA's own causal kernels, no mask tensor
            self.attn_mask, self.is_causal = None, s > 1
            return
        self.is_causal = False
        queries = torch.arange(t - s, t, device=new_mask.device)[:, None]
        keys = torch.arange(t, device=new_mask.device)[None, :]
        seen = (keys <= queries)[None] & self.mask[:, None, :]
        # a padding query sees itself, so that no row of the softmax is empty (NaN would reach the values)
        self.attn_mask = (seen | (keys == queries)[None])[:, None]

    def layer(self, index: int) -> "LayerCache":
        return LayerCache(self, index)

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append layer ``index``'s new keys and values [b, h, s, d]; all of them so far."""
        if self.keys[index] is not None:
            k = torch.cat([self.keys[index], k], dim=2)
            v = torch.cat([self.values[index], v], dim=2)
        self.keys[index], self.values[index] = k, v
        return k, v


class LayerCache:
    """One layer's view of a ``KVCache`` (what ``Attention.forward`` gets)."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def positions(self) -> torch.Tensor:
        return self.cache.positions

    @property
    def attn_mask(self) -> torch.Tensor | None:
        return self.cache.attn_mask

    @property
    def is_causal(self) -> bool:
        return self.cache.is_causal

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v)
