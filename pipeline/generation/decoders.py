"""A model as a decoder: ``start(ids, mask)`` reads the left-padded prompts and ``next(tokens, alive)`` one token
more per row, each returning the full-vocabulary fp32 logits [b, V] of the last position, the same on every rank
of a tensor-parallel group (the vocabulary slices are all-gathered, for the last position only).

``GPTDecoder`` keeps a ``models.kv_cache.KVCache`` (or, ``use_cache=False``, re-reads the whole sequence at every
step: the baseline of bench/generate.py); ``MLSTMDecoder`` carries the mLSTM's recurrent state, which is its cache.
The model family names its decoder (``pipeline.job.families``, ``"decoder"``).
"""
from __future__ import annotations

import torch

from models.gpt import gather_vocab_logits
from models.kv_cache import KVCache
from pipeline.job.families import family_of


class GPTDecoder:
    def __init__(self, model, use_cache: bool = True):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_sequence_length
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.cache = self.ids = self.mask = None

    def _read(self, ids: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.read(mask)
        local = self.model.parallel_logits(ids, cache)[:, -1]
        return gather_vocab_logits(local, self.vocab_size).float()

    @torch.no_grad()
    def start(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.cache = KVCache(self.model.config.num_layers)
        self.ids, self.mask = ids, mask
        return self._read(ids, mask, self.cache)

    @torch.no_grad()
    def next(self, tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """``alive`` [b]: rows still generating (a finished row reads a masked token, so it goes no further)."""
        tokens, alive = tokens[:, None], alive[:, None]
        if self.use_cache:
            return self._read(tokens, alive, self.cache)
        self.ids, self.mask = torch.cat([self.ids, tokens], 1), torch.cat([self.mask, alive], 1)
        return self._read(self.ids, self.mask, KVCache(self.model.config.num_layers))


class MLSTMDecoder:
    """Each prompt is read alone from a zero state (a padding token would change the state); the rows' states
    are then stacked and decoded together. The mLSTM reads any length (``max_positions`` None). Without the
    cache, every row is re-read from a zero state at every step."""

    def __init__(self, model, use_cache: bool = True):
        self.model = model
        self.max_positions = None
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.state = self.rows = None

    def _read_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        logits, hs, cs = [], [], []
        with self.model.isolated_state():  # a training stream's carried state survives the sampling
            for row in rows:
                out, (h, c) = self.model(row[None])
                logits.append(out[:, -1])
                hs.append(h)
                cs.append(c)
        self.state = torch.cat(hs, 1), torch.cat(cs, 1)
        return torch.cat(logits).float()

    @torch.no_grad()
    def start(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.rows = [row[keep] for row, keep in zip(ids, mask.bool())]
        return self._read_rows(self.rows)

    @torch.no_grad()
    def next(self, tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        if not self.use_cache:
            self.rows = [torch.cat([row, t[None]]) for row, t in zip(self.rows, tokens)]
            return self._read_rows(self.rows)
        with self.model.isolated_state():
            out, self.state = self.model(tokens[:, None], state=self.state)
        return out[:, -1].float()


def decoder_for(model, use_cache: bool = True):
    """The decoder the model's family registers."""
    return family_of(model.config).get("decoder")(model, use_cache=use_cache)
