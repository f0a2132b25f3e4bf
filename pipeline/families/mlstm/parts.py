"""The mLSTM family's parts (byte-level, data parallel only): a scorer reading each window from a zero state, a
decoder carrying the recurrent state (its cache), a finetuning encoder summarising each text by its last cell state
(the interfaces: ``pipeline.families.gpt.parts``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.families.common import LayerDepths, ProjectScorer, TokenScores
from models.gpt import seeded_init
from models.mlstm import MLSTM, MLSTMConfig


class MLSTMScorer(ProjectScorer):
    """The project's ``models.MLSTM`` (one process per data-parallel rank): each window is read from a zero
    state, as the exported ``MLSTMForCausalLM`` reads it. Its window is the TBPTT length it trained with."""

    def __init__(self, model):
        super().__init__(model, model.config.seq_length)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, *, greedy: bool = False) -> TokenScores:
        ids = ids.to(self.device)
        logits, _ = self.model(ids[:, :-1])
        nll = torch.stack([F.cross_entropy(row.float(), t, reduction="none") for row, t in zip(logits, ids[:, 1:])])
        return TokenScores(nll, logits.argmax(-1) if greedy else None)


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


class MLSTMEncoder(LayerDepths, MLSTM):
    """The byte-level mLSTM (data parallel only), with the encoder interface: each text's summary is the last
    layer's cell state after its last byte, as in the sentiment-neuron work. Same parameter names as ``MLSTM``."""

    default_pooling = "none"  # it summarises each text itself

    def __init__(self, config: MLSTMConfig, init_seed: int | None = None):
        with seeded_init(init_seed):
            super().__init__(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return super().features(input_ids, lengths)

    def router_loss(self) -> None:
        return None  # no experts

    def lm_loss(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy over the real bytes (a second pass: the features are cell states)."""
        s = input_ids.shape[1]
        targets = input_ids[:, 1:].masked_fill(
            torch.arange(1, s, device=input_ids.device)[None, :] >= lengths[:, None], -100)
        if s < 2 or not bool((targets != -100).any()):
            return features.new_zeros((), dtype=torch.float32)
        loss, _ = MLSTM.forward(self, input_ids[:, :-1], targets)
        return loss
