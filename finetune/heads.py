"""A classification head over a language model's hidden states, and its losses.

Model-agnostic: the head takes hidden states ``[b, s, h]`` with a mask of real tokens (an attention mask,
1 = token, or per-row lengths), pools them to ``[b, h]`` and maps that to logits ``[b, num_labels]``.
Encoders whose summary is already one vector per text (the mLSTM's final cell state ``[b, h]``) use
``pooling="none"``.

Pooling:
  last      - each row's last real token. Under causal attention it is the only position that has read
              the whole text (the GPT; the paper's choice). Right or left padding both work with a mask;
              ``lengths`` means right padding.
  mean, max - over the real tokens only.
  attention - a learned score per token, softmax over the real tokens, weighted sum.
  labels    - the label names read with the text (SpanEmo's idea, Alhuzali and Ananiadou 2021, for a
              decoder): every text ends with ``label_prompt`` (token ids: a separator, then each label's
              name), and label k's logit comes from the hidden state at the last token of its own name
              (``label_positions[k]`` within the prompt), which has read the whole text; one output row per
              label, applied to that label's vector.
  none      - the input is already pooled [b, h].

The head is small and replicated: under tensor parallelism every rank holds it whole and receives the
same (full) hidden states, and its dropout draws from the default generator, which is seeded alike
across the ranks of a tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._io import strict_from_dict

POOLINGS = ("last", "mean", "max", "attention", "labels", "none")
MULTILABEL, SINGLE_LABEL = "multilabel", "single_label"
_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_labels: int
    pooling: str = "last"
    mlp_hidden: tuple[int, ...] = ()  # hidden widths of an optional MLP before the output layer; () = linear
    dropout: float = 0.1  # on the pooled vector and after each MLP layer
    activation: str = "gelu"
    problem_type: str = MULTILABEL  # multilabel: sigmoid + BCE; single_label: softmax + cross-entropy
    attention_hidden: int | None = None  # attention pooling scorer: None = linear, else a tanh MLP this wide
    label_names: tuple[str, ...] | None = None
    output_bias: bool = True  # False: a bias-free output layer (what Hugging Face's Llama classifier can hold)
    label_prompt: tuple[int, ...] = ()     # pooling "labels": token ids appended to every text
    label_positions: tuple[int, ...] = ()  # pooling "labels": each label's last token within label_prompt

    def __post_init__(self):
        object.__setattr__(self, "mlp_hidden", tuple(int(w) for w in self.mlp_hidden))
        object.__setattr__(self, "label_prompt", tuple(int(t) for t in self.label_prompt))
        object.__setattr__(self, "label_positions", tuple(int(t) for t in self.label_positions))
        if self.label_names is not None:
            object.__setattr__(self, "label_names", tuple(self.label_names))
        problems = []
        if self.hidden_size < 1 or self.num_labels < 1:
            problems.append(f"hidden_size ({self.hidden_size}) and num_labels ({self.num_labels}) must be >= 1")
        if self.pooling not in POOLINGS:
            problems.append(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if any(w < 1 for w in self.mlp_hidden):
            problems.append(f"mlp_hidden widths must be >= 1, got {self.mlp_hidden}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.activation not in _ACTIVATIONS:
            problems.append(f"activation must be one of {tuple(_ACTIVATIONS)}, got {self.activation!r}")
        if self.problem_type not in (MULTILABEL, SINGLE_LABEL):
            problems.append(f"problem_type must be {MULTILABEL!r} or {SINGLE_LABEL!r}, got {self.problem_type!r}")
        if self.problem_type == SINGLE_LABEL and self.num_labels < 2:
            problems.append("a single-label head needs num_labels >= 2 (use multilabel with 1 label for binary BCE)")
        if self.attention_hidden is not None and self.attention_hidden < 1:
            problems.append(f"attention_hidden must be >= 1 or None, got {self.attention_hidden}")
        if self.label_names is not None and len(self.label_names) != self.num_labels:
            problems.append(f"{len(self.label_names)} label_names for num_labels={self.num_labels}")
        problems += self._label_prompt_problems()
        if problems:
            raise ValueError("invalid HeadConfig: " + "; ".join(problems))

    def _label_prompt_problems(self) -> list[str]:
        if self.pooling != "labels":
            return ["label_prompt and label_positions are for pooling='labels'"] if (
                self.label_prompt or self.label_positions) else []
        problems = []
        if len(self.label_positions) != self.num_labels:
            problems.append(f"pooling='labels' needs one label position per label: {len(self.label_positions)} "
                            f"for {self.num_labels} labels")
        if any(not 0 <= i < len(self.label_prompt) for i in self.label_positions):
            problems.append(f"label_positions {list(self.label_positions)} fall outside the label prompt of "
                            f"{len(self.label_prompt)} tokens")
        if self.mlp_hidden:
            problems.append("pooling='labels' takes a linear head (one output row per label's vector), not an MLP")
        return problems

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mlp_hidden"] = list(self.mlp_hidden)
        d["label_prompt"], d["label_positions"] = list(self.label_prompt), list(self.label_positions)
        d["label_names"] = None if self.label_names is None else list(self.label_names)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        return strict_from_dict(cls, d, "HeadConfig keys")


# ------------------------------------------------------------------------------------------- pooling

def real_token_mask(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Bool [b, s], True at real tokens, from an attention mask (nonzero = token) or lengths (right
    padding); neither = every position is real. Rows without any real token are refused."""
    b, s = hidden_states.shape[:2]
    device = hidden_states.device
    if attention_mask is not None and lengths is not None:
        raise ValueError("give attention_mask or lengths, not both")
    if attention_mask is not None:
        if attention_mask.shape != (b, s):
            raise ValueError(f"attention_mask {list(attention_mask.shape)} does not match hidden states [{b}, {s}, h]")
        mask = attention_mask.to(device) != 0
    elif lengths is not None:
        lengths = torch.as_tensor(lengths, device=device)
        if lengths.shape != (b,):
            raise ValueError(f"lengths {list(lengths.shape)} must be [{b}]")
        if bool((lengths > s).any()):
            raise ValueError(f"a length exceeds the sequence length {s}")
        mask = torch.arange(s, device=device)[None, :] < lengths[:, None]
    else:
        return torch.ones(b, s, dtype=torch.bool, device=device)
    if not bool(mask.any(dim=1).all()):
        raise ValueError("a row has no real token (empty text?)")
    return mask


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Position of each row's last real token, long [b] (works for right and left padding)."""
    s = mask.shape[1]
    return (s - 1) - mask.flip(1).to(torch.int8).argmax(dim=1)


def pool_last(hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    idx = last_token_index(mask)
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), idx]


def pool_labels(hidden_states: torch.Tensor, mask: torch.Tensor, prompt_length: int,
                label_positions: Sequence[int]) -> torch.Tensor:
    """[b, k, h]: the hidden state at each label's position in the label prompt that ends every text."""
    start = last_token_index(mask) - (prompt_length - 1)  # where each row's prompt begins
    if bool((start < 0).any()):
        raise ValueError(f"a row is shorter than the label prompt of {prompt_length} tokens it must end with")
    positions = start[:, None] + torch.as_tensor(label_positions, device=mask.device)[None, :]
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device)[:, None], positions]


def pool_mean(hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden_states.float() * m).sum(dim=1)  # fp32 sum: bf16 loses digits over long texts
    return (summed / m.sum(dim=1)).to(hidden_states.dtype)


def pool_max(hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    fill = torch.finfo(hidden_states.dtype).min
    return hidden_states.masked_fill(~mask.unsqueeze(-1), fill).max(dim=1).values


class AttentionPooling(nn.Module):
    """Softmax over per-token scores (linear, or a one-hidden-layer tanh scorer), restricted to real tokens."""

    def __init__(self, hidden_size: int, attention_hidden: int | None = None):
        super().__init__()
        if attention_hidden is None:
            self.scorer = nn.Linear(hidden_size, 1)
        else:
            self.scorer = nn.Sequential(nn.Linear(hidden_size, attention_hidden), nn.Tanh(),
                                        nn.Linear(attention_hidden, 1))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.scorer(hidden_states).squeeze(-1).float()
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
        return torch.einsum("bs,bsh->bh", weights, hidden_states.float()).to(hidden_states.dtype)


# ---------------------------------------------------------------------------------------------- head

class ClassificationHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.attention = (AttentionPooling(config.hidden_size, config.attention_hidden)
                          if config.pooling == "attention" else None)
        layers: list[nn.Module] = [nn.Dropout(config.dropout)]
        width = config.hidden_size
        for hidden in config.mlp_hidden:
            layers += [nn.Linear(width, hidden), _ACTIVATIONS[config.activation](), nn.Dropout(config.dropout)]
            width = hidden
        self.output = nn.Linear(width, config.num_labels, bias=config.output_bias)
        self.classifier = nn.Sequential(*layers, self.output)
        nn.init.normal_(self.output.weight, std=0.02)
        if self.output.bias is not None:
            nn.init.zeros_(self.output.bias)

    def pool(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """[b, s, h] (or already pooled [b, h] with pooling="none") -> [b, h] ([b, k, h] with "labels")."""
        h = self.config.hidden_size
        if self.config.pooling == "none":
            if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
                raise ValueError(f"pooling='none' takes pooled inputs [b, {h}], got {list(hidden_states.shape)}")
            if attention_mask is not None or lengths is not None:
                raise ValueError("pooling='none' takes no attention_mask / lengths (the input is already pooled)")
            return hidden_states
        if hidden_states.dim() != 3 or hidden_states.shape[2] != h:
            raise ValueError(f"pooling={self.config.pooling!r} takes hidden states [b, s, {h}], "
                             f"got {list(hidden_states.shape)} (pooled [b, h] inputs need pooling='none')")
        mask = real_token_mask(hidden_states, attention_mask, lengths)
        if self.config.pooling == "last":
            return pool_last(hidden_states, mask)
        if self.config.pooling == "mean":
            return pool_mean(hidden_states, mask)
        if self.config.pooling == "max":
            return pool_max(hidden_states, mask)
        if self.config.pooling == "labels":
            return pool_labels(hidden_states, mask, len(self.config.label_prompt), self.config.label_positions)
        return self.attention(hidden_states, mask)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        return self.classify(self.pool(hidden_states, attention_mask, lengths))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits [b, k] of pooled vectors: [b, h] through the classifier, or [b, k, h] (pooling "labels"),
        each label's own vector times its own output row."""
        pooled = pooled.to(self.output.weight.dtype)
        if pooled.dim() == 2:
            return self.classifier(pooled)
        logits = torch.einsum("bkh,kh->bk", self.classifier[0](pooled), self.output.weight)  # [0]: the dropout
        return logits if self.output.bias is None else logits + self.output.bias

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor | None = None,
             reduction: str = "mean") -> torch.Tensor:
        """BCE for multilabel heads (targets 0/1 [b, k]); cross-entropy for single-label heads (targets
        class indices [b] or class probabilities [b, k]). ``pos_weight`` is for BCE only."""
        if self.config.problem_type == MULTILABEL:
            return multilabel_bce_loss(logits, targets, pos_weight=pos_weight, reduction=reduction)
        if pos_weight is not None:
            raise ValueError("pos_weight is for multilabel (BCE) heads; single-label heads take class weights via "
                             "single_label_ce_loss(weight=...)")
        return single_label_ce_loss(logits, targets, reduction=reduction)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Sigmoid per label (multilabel) or softmax over classes (single-label), in fp32."""
        logits = logits.float()
        return torch.sigmoid(logits) if self.config.problem_type == MULTILABEL else torch.softmax(logits, dim=-1)

    @torch.no_grad()
    def set_output_bias_from_priors(self, priors: Sequence[float] | np.ndarray | torch.Tensor):
        """Start the output at the label base rates (bias = logit of each prior) instead of 0.5 each: with
        rare labels the first BCE steps then refine instead of first unlearning a 50% positive rate."""
        if self.output.bias is None:
            raise ValueError("this head has no output bias (HeadConfig.output_bias=False)")
        p = torch.as_tensor(np.asarray(priors, dtype=np.float64)).clamp(1e-4, 1 - 1e-4)
        if p.shape != (self.config.num_labels,):
            raise ValueError(f"{p.numel()} priors for {self.config.num_labels} labels")
        bias = torch.log(p) - torch.log1p(-p) if self.config.problem_type == MULTILABEL else torch.log(p / p.sum())
        self.output.bias.copy_(bias.to(self.output.bias.dtype))


# -------------------------------------------------------------------------------------------- losses

def multilabel_bce_loss(logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor | None = None,
                        reduction: str = "mean") -> torch.Tensor:
    """Sigmoid + binary cross-entropy, in fp32 whatever the logits' dtype. ``pos_weight`` [k] multiplies the
    loss of each label's positives (``pos_weight_from_counts`` for the usual negatives/positives)."""
    if logits.shape != targets.shape:
        raise ValueError(f"logits {list(logits.shape)} and targets {list(targets.shape)} differ")
    if pos_weight is not None:
        pos_weight = torch.as_tensor(pos_weight, dtype=torch.float32, device=logits.device)
        if pos_weight.shape != logits.shape[-1:]:
            raise ValueError(f"pos_weight {list(pos_weight.shape)} must be [{logits.shape[-1]}]")
    return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), pos_weight=pos_weight,
                                              reduction=reduction)


def single_label_ce_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None,
                         label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Softmax cross-entropy in fp32; targets are class indices [b] or class probabilities [b, k]."""
    if weight is not None:
        weight = torch.as_tensor(weight, dtype=torch.float32, device=logits.device)
    targets = targets.long() if targets.dim() == 1 else targets.float()
    return F.cross_entropy(logits.float(), targets, weight=weight, label_smoothing=label_smoothing,
                           reduction=reduction)


def pos_weight_from_counts(positives: Sequence[int] | np.ndarray, total: int,
                           max_weight: float | None = None) -> torch.Tensor:
    """BCE positive weights float32 [k]: negatives / positives per label (so both sides weigh the same),
    optionally capped at ``max_weight`` (rare labels otherwise get weights of 20+ and noisy gradients).
    A label without positives gets 1."""
    pos = np.asarray(positives, dtype=np.float64)
    if pos.ndim != 1 or np.any(pos < 0) or np.any(pos > total):
        raise ValueError(f"positives must be a 1-D count per label within [0, {total}]")
    weight = np.where(pos > 0, (total - pos) / np.maximum(pos, 1), 1.0)
    if max_weight is not None:
        weight = np.minimum(weight, max_weight)
    return torch.tensor(weight, dtype=torch.float32)


def pos_weight_from_labels(labels: np.ndarray | torch.Tensor, max_weight: float | None = None) -> torch.Tensor:
    """``pos_weight_from_counts`` from a 0/1 label matrix [n, k] (the training labels)."""
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise ValueError(f"labels must be [n, num_labels], got {list(labels.shape)}")
    return pos_weight_from_counts(labels.sum(axis=0), labels.shape[0], max_weight=max_weight)
