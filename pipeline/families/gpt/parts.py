"""The GPT family's parts (gpt2 and llama variants, dense or MoE): a scorer at any tensor- and context-parallel size,
a decoder with a KV cache, a finetuning encoder.

Encoder interface (``finetune.model.Classifier`` puts a head on one):
  ``features(input_ids, lengths)`` -> hidden states [b, s, h] (the GPT), or one vector per text [b, h] (the
                                 mLSTM's final cell state, the sentiment neuron's features; pooling "none");
  ``lm_loss(features, ids, lengths)`` -> the next-token loss over real tokens (the auxiliary LM objective);
  ``depth_of(param_name)``    -> 0 (input side) .. ``num_depths`` - 1 (output side), for layer-wise LR decay.
Decoder interface (``pipeline.generation``): ``start(ids, mask)`` reads the left-padded prompts and
``next(tokens, alive)`` one token more per row, each returning the full-vocabulary fp32 logits [b, V] of the last
position, the same on every rank of a tensor-parallel group (the vocabulary slices are all-gathered, for the last
position only). ``use_cache=False`` re-reads the whole sequence at every step (the baseline of bench/generate.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.families.common import LayerDepths, ProjectScorer, TokenScores, vocab_parallel_argmax
from models.gpt import GPT, gather_vocab_logits
from models.kv_cache import KVCache
from models.parallel import (context_chunk, cp_world_size, gather_from_context_parallel_region, tp_world_size,
                             vocab_parallel_cross_entropy)


class GPTScorer(ProjectScorer):
    """The project's ``models.GPT`` at any tensor- and context-parallel size (call it on every rank of the TP x CP
    group). Under context parallelism each rank scores its chunk of the window, the window right-padded to a
    multiple of CP (causal: the padding changes no earlier score), and the chunks' scores are all-gathered."""

    def __init__(self, model):
        super().__init__(model, model.config.max_sequence_length)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, *, greedy: bool = False) -> TokenScores:
        ids = ids.to(self.device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        n, pad = inputs.shape[1], -inputs.shape[1] % cp_world_size()
        if pad:
            inputs, targets = F.pad(inputs, (0, pad)), F.pad(targets, (0, pad))
        local = self.model.parallel_logits(inputs)  # this rank's chunk under CP
        nll = vocab_parallel_cross_entropy(local, context_chunk(targets), vocab_size=self.vocab_size,
                                           reduction="none")
        best = vocab_parallel_argmax(local, self.vocab_size) if greedy else None
        nll = gather_from_context_parallel_region(nll.float())[:, :n]
        return TokenScores(nll, None if best is None else gather_from_context_parallel_region(best)[:, :n])


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


class GPTEncoder(LayerDepths, GPT):
    """The project GPT, with the encoder interface. Same parameters and names as ``GPT``, so a GPT state
    dict loads into it unchanged."""

    default_pooling = "last"  # hidden states per token: the head pools them

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        # causal: the padding after each row's length changes nothing. Sequence and context parallelism cut the
        # sequence into TP (x CP) equal chunks: a batch is padded to that multiple here, cut back after the gather.
        s = input_ids.shape[1]
        pad = -s % ((tp_world_size() if self.layout.sequence_parallel else 1) * cp_world_size())
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        return self.hidden_states(input_ids)[:, :s]

    def lm_loss(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the real tokens of right-padded rows (position t predicts
        t + 1 while t + 1 < length); vocab-parallel, so it never gathers the full logits."""
        s = input_ids.shape[1]
        if s < 2:
            return features.new_zeros((), dtype=torch.float32)
        targets = input_ids[:, 1:].masked_fill(
            torch.arange(1, s, device=input_ids.device)[None, :] >= lengths[:, None], -100)
        if not bool((targets != -100).any()):
            return features.new_zeros((), dtype=torch.float32)
        h = features[:, :-1]  # the whole sequence, replicated over TP (also under sequence parallelism)
        logits = self.embedding.logits(h, False) if self.lm_head is None else self.lm_head(h, False)
        return vocab_parallel_cross_entropy(logits, targets, vocab_size=self.config.vocab_size, ignore_index=-100)

    def router_loss(self) -> torch.Tensor | None:
        """The MoE layers' auxiliary losses of the last forward (load balancing, router z-loss, with their
        coefficients), as pretraining adds them; None without experts. Padding is routed too (dropless, it changes
        no real token's output; with a capacity factor it takes places in the experts)."""
        return self.moe_aux_loss() if self.config.num_experts else None
