"""A text classifier: a project language model (the encoder) with a ``ClassificationHead`` on top.

    encoder = build_encoder("gpt", gpt_config, init_seed=0)          # any GPT variant, any TP size
    model = Classifier(encoder, HeadConfig(gpt_config.hidden_size, 11, pooling="last"), aux_lm_weight=0.5)
    loss = model(input_ids, labels, lengths=lengths)                 # BCE (or CE) [+ weight x LM loss]
    probs = model.predict_proba(input_ids, lengths=lengths)          # fp32 [b, k]

The encoder interface (``features``, ``lm_loss``, ``depth_of``) is model-side code in each family's folder
(``pipeline.families.<family>.parts``), whose encoders the family spec (``pipeline.job.families``) holds.

Inputs are right padded: the GPT's attention is causal, so padding after a text changes none of its
positions. Base weights come from ``finetune.saved.load_full_gpt_state(directory)``: a pretraining checkpoint of this
project (DeepSpeed files at any TP/PP layout), a directory of ``config.json`` + ``model.safetensors``
(a full TP=1 state dict, what ``pipeline.import_hf`` writes), or a finetuned classifier directory.
Each TP rank cuts its own shard of every full tensor (``pipeline.checkpoints.state_dicts.load_full_state_dict``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from models.parallel import cp_world_size, scale_gradient
from pipeline.job.errors import UserError
from pipeline.job.families import family_named, family_of

from .heads import MULTILABEL, ClassificationHead, HeadConfig
from models.gpt import seeded_init
from pipeline.checkpoints.state_dicts import load_full_state_dict

ENCODER_PREFIX = "encoder."


class BaseModelError(UserError, ValueError):
    """A base model directory that cannot be read (the message names the directory and the file)."""


# ------------------------------------------------------------------------------------------- encoders

def encoder_type_of(config) -> str:
    """The model family of an encoder config (pipeline.job.families): its name is the encoder type."""
    return family_of(config).name


def build_encoder(encoder_type: str, config, init_seed: int | None = None) -> nn.Module:
    return family_named(encoder_type, "encoder type").get("encoder")(config, init_seed=init_seed)


def encoder_config_from_dict(encoder_type: str, d: dict, source: str = "encoder config"):
    return family_named(encoder_type, source).config_class.from_dict(d, source=source)


# ----------------------------------------------------------------------------------------- classifier

class Classifier(nn.Module):
    """``encoder`` + ``ClassificationHead``. ``forward(input_ids, labels, lengths=...)`` is the training loss;
    without labels it returns the logits [b, k].

    ``labels`` are the 0/1 matrix [b, k] (float or int) for both problem types: a single-label head takes
    each row's one-hot class. ``pos_weight`` [k] weighs the positives of each label in BCE.
    ``aux_lm_weight`` > 0 adds that multiple of the encoder's next-token loss on the same texts (the
    auxiliary language-model objective of GPT-1 and of the paper). ``freeze_encoder`` trains the head
    alone (a linear probe with a linear head); the encoder then runs without gradients. ``freeze_embeddings``
    keeps the input embeddings as they are (often the largest matrix of a small model; the rows of the tokens
    a small dataset never shows would only decay).
    """

    def __init__(self, encoder: nn.Module, head_config: HeadConfig, *, aux_lm_weight: float = 0.0,
                 pos_weight: Sequence[float] | torch.Tensor | None = None, freeze_encoder: bool = False,
                 freeze_embeddings: bool = False, encoder_type: str = "gpt", label_correlation: float = 0.0):
        super().__init__()
        if head_config.hidden_size != encoder.hidden_size:
            raise ValueError(f"head hidden_size {head_config.hidden_size} differs from the encoder's "
                             f"{encoder.hidden_size}")
        if aux_lm_weight < 0:
            raise ValueError(f"aux_lm_weight must be >= 0, got {aux_lm_weight}")
        if aux_lm_weight and freeze_encoder:
            raise ValueError("an auxiliary LM loss trains the encoder: it cannot be combined with a frozen encoder")
        if not 0.0 <= label_correlation < 1.0:
            raise ValueError(f"label_correlation must be in [0, 1), got {label_correlation}")
        if label_correlation and head_config.problem_type != MULTILABEL:
            raise ValueError("the label-correlation loss is for multilabel heads")
        self.label_correlation = float(label_correlation)
        self.encoder = encoder
        self.head = ClassificationHead(head_config)
        self.encoder_type = encoder_type
        self.aux_lm_weight = float(aux_lm_weight)
        self.pos_weight = None if pos_weight is None else torch.as_tensor(pos_weight, dtype=torch.float32)
        if self.pos_weight is not None and self.pos_weight.shape != (head_config.num_labels,):
            raise ValueError(f"pos_weight {list(self.pos_weight.shape)} must be [{head_config.num_labels}]")
        self.freeze_encoder = bool(freeze_encoder)
        if freeze_encoder:
            encoder.requires_grad_(False)
        if freeze_embeddings:
            encoder.embedding.requires_grad_(False)

    @property
    def config(self) -> HeadConfig:
        return self.head.config

    def _lengths(self, input_ids, lengths, attention_mask) -> torch.Tensor:
        b, s = input_ids.shape
        if lengths is not None and attention_mask is not None:
            raise ValueError("give lengths or attention_mask, not both")
        if attention_mask is not None:
            mask = attention_mask.to(input_ids.device) != 0
            lengths = mask.sum(dim=1)
            if not torch.equal(mask, torch.arange(s, device=mask.device)[None, :] < lengths[:, None]):
                raise ValueError("the classifier takes right-padded inputs (each attention_mask row 1...1 0...0): "
                                 "with left padding the padding would sit inside the causal context")
        elif lengths is None:
            return torch.full((b,), s, dtype=torch.long, device=input_ids.device)
        lengths = torch.as_tensor(lengths, device=input_ids.device).long()
        if lengths.shape != (b,) or bool((lengths < 1).any()) or bool((lengths > s).any()):
            raise ValueError(f"lengths must be [{b}] values in 1..{s}, got {lengths.tolist()}")
        return lengths

    def _features(self, input_ids, lengths):
        if self.freeze_encoder:
            with torch.no_grad():
                return self.encoder.features(input_ids, lengths)
        return self.encoder.features(input_ids, lengths)

    def pool(self, input_ids: torch.Tensor, *, lengths: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input [b, h]: encoder features pooled over the real tokens."""
        lengths = self._lengths(input_ids, lengths, attention_mask)
        features = self._features(input_ids, lengths)
        return features if features.dim() == 2 else self.head.pool(features, lengths=lengths)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                lengths: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                pooled: torch.Tensor | None = None, return_parts: bool = False):
        """The loss with ``labels``, else the logits [b, k]. ``pooled`` [b, h] (from ``pool``, e.g. computed
        once for a frozen encoder) replaces ``input_ids``: the head alone runs. ``return_parts``: with labels,
        a dict of the loss and its parts (``cls_loss``, ``lm_loss``, an MoE encoder's ``moe_aux_loss``; detached)
        instead of the loss alone."""
        if pooled is not None:
            if input_ids is not None or self.training and not self.freeze_encoder:
                raise ValueError("pooled features replace input_ids, and train only the head of a frozen encoder")
            logits = self.head.classify(pooled)
            features = None
        else:
            lengths = self._lengths(input_ids, lengths, attention_mask)
            # under context parallelism the head and the aux LM loss run replicated on the C ranks, whose
            # gradients DeepSpeed sums: the loss passes 1 / C of its gradient back, the encoder's chunks C times that
            features = scale_gradient(self._features(input_ids, lengths), cp_world_size())
            if features.dim() == 2:  # the encoder summarises each text itself ([b, h]; pooling "none")
                logits = self.head(features)
            else:
                logits = self.head(features, lengths=lengths)
        if labels is None:
            return logits
        loss = self.classification_loss(logits, labels)
        parts = {"cls_loss": loss.detach()}
        if self.aux_lm_weight and self.training:
            lm = self.encoder.lm_loss(features, input_ids, lengths)
            parts["lm_loss"] = lm.detach()
            loss = loss + self.aux_lm_weight * lm
        router = self.encoder.router_loss() if self.training and pooled is None and not self.freeze_encoder else None
        if router is not None:
            parts["moe_aux_loss"] = router.detach()
            loss = loss + router
        loss = scale_gradient(loss, 1 / cp_world_size())
        return {"loss": loss, **parts} if return_parts else loss

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type == MULTILABEL:
            bce = self.head.loss(logits, labels.float(), pos_weight=self.pos_weight)
            if not self.label_correlation:
                return bce
            a = self.label_correlation
            return (1 - a) * bce + a * label_correlation_loss(logits, labels)
        return self.head.loss(logits, labels.argmax(dim=-1) if labels.dim() == 2 else labels)

    @torch.no_grad()
    def predict_proba(self, input_ids: torch.Tensor, *, lengths: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Probabilities fp32 [b, k] (sigmoid per label, or softmax), in eval mode (no dropout)."""
        was_training = self.training
        self.eval()
        try:
            return self.head.probabilities(self(input_ids, lengths=lengths, attention_mask=attention_mask))
        finally:
            self.train(was_training)

    def param_groups(self, *, weight_decay: float | None = None, layer_lr_decay: float = 1.0,
                     head_lr_mult: float = 1.0) -> list[dict]:
        """Optimizer groups with an ``lr_mult`` (the project's LR scheduler multiplies each group's
        learning rate by it). Layer-wise decay: the head and the encoder's top get 1, each depth below
        one more factor ``layer_lr_decay`` (ULMFiT's discriminative rates, BEiT/ELECTRA's layer decay).
        Biases and norm weights (1-D tensors) get no weight decay. Frozen parameters are left out."""
        if not 0.0 < layer_lr_decay <= 1.0:
            raise ValueError(f"layer_lr_decay must be in (0, 1], got {layer_lr_decay}")
        if head_lr_mult <= 0:
            raise ValueError(f"head_lr_mult must be > 0, got {head_lr_mult}")
        top = self.encoder.num_depths - 1
        groups: dict[tuple[float, bool], list] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith(ENCODER_PREFIX):
                mult = layer_lr_decay ** (top - self.encoder.depth_of(name[len(ENCODER_PREFIX):]))
            else:
                mult = head_lr_mult
            groups.setdefault((mult, p.ndim < 2), []).append(p)
        out = []
        for (mult, no_decay), params in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            group = {"params": params, "lr_mult": mult}
            if no_decay:
                group["weight_decay"] = 0.0
            elif weight_decay is not None:
                group["weight_decay"] = weight_decay
            out.append(group)
        return out


def label_correlation_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SpanEmo's label-correlation-aware loss (Alhuzali and Ananiadou 2021): per text, the mean over every
    (present p, absent q) pair of exp(prob_q - prob_p), so that each present emotion is pushed above each
    absent one; texts with no present or no absent label add nothing. fp32, mean over the texts that count."""
    probs, y = torch.sigmoid(logits.float()), labels.float()
    pair = y.unsqueeze(2) * (1 - y).unsqueeze(1)  # [b, p, q]: 1 where p is present and q absent
    terms = torch.exp(probs.unsqueeze(1) - probs.unsqueeze(2)) * pair  # exp(prob_q - prob_p)
    pairs = pair.sum(dim=(1, 2))
    counted = pairs > 0
    per_text = terms.sum(dim=(1, 2))[counted] / pairs[counted]
    return per_text.sum() / counted.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------- building

def build_classifier(encoder_config, head_config: HeadConfig, *, encoder_type: str | None = None,
                     encoder_state: Mapping[str, torch.Tensor] | None = None, init_seed: int = 1234,
                     aux_lm_weight: float = 0.0, pos_weight=None, freeze_encoder: bool = False,
                     freeze_embeddings: bool = False, label_correlation: float = 0.0,
                     label_priors: Sequence[float] | np.ndarray | None = None,
                     source: str = "base model") -> Classifier:
    """A classifier for this rank's TP shard: the encoder from ``encoder_state`` (a full state dict; None =
    random init from ``init_seed``), the head from its own seed (same on every rank) and, given label
    priors and an output bias, with its bias at the priors' logits. ``encoder_type``: from the config's type."""
    encoder_type = encoder_type or encoder_type_of(encoder_config)
    encoder = build_encoder(encoder_type, encoder_config, init_seed=init_seed)
    if encoder_state is not None:
        load_full_state_dict(encoder, encoder_state, source=source)
    with seeded_init(init_seed + 7919):
        model = Classifier(encoder, head_config, aux_lm_weight=aux_lm_weight, pos_weight=pos_weight,
                           freeze_encoder=freeze_encoder, freeze_embeddings=freeze_embeddings,
                           encoder_type=encoder_type, label_correlation=label_correlation)
    if label_priors is not None and head_config.output_bias:
        model.head.set_output_bias_from_priors(label_priors)
    return model
