"""The mLSTM as a Hugging Face ``PreTrainedModel``, registered with the Auto classes on import.

    import models.hf_mlstm  # registers "mlstm-lm"
    model = transformers.AutoModelForCausalLM.from_pretrained("exported_mlstm")

The class ships in this package, so loading needs no ``trust_remote_code``: importing
the package is the trust decision. The weights are the project model's, under ``mlstm.``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .mlstm import MLSTM, MLSTMConfig

MODEL_TYPE = "mlstm-lm"
_FIELDS = ("vocab_size", "embed_dim", "hidden_size", "num_layers", "weight_norm", "dropout", "seq_length",
           "init_range")


class MLSTMHFConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=257, embed_dim=64, hidden_size=4096, num_layers=1, weight_norm="all", dropout=0.0,
                 seq_length=256, init_range=None, **kwargs):
        self.vocab_size, self.embed_dim, self.hidden_size = vocab_size, embed_dim, hidden_size
        self.num_layers, self.weight_norm, self.dropout = num_layers, weight_norm, dropout
        self.seq_length, self.init_range = seq_length, init_range
        super().__init__(**kwargs)

    @classmethod
    def from_project(cls, config: MLSTMConfig, **kwargs) -> "MLSTMHFConfig":
        return cls(**{f: getattr(config, f) for f in _FIELDS}, **kwargs)

    def to_project(self) -> MLSTMConfig:
        return MLSTMConfig(**{f: getattr(self, f) for f in _FIELDS})


class MLSTMForCausalLM(PreTrainedModel):
    config_class = MLSTMHFConfig
    base_model_prefix = "mlstm"
    main_input_name = "input_ids"

    def __init__(self, config: MLSTMHFConfig):
        super().__init__(config)
        self.mlstm = MLSTM(config.to_project())
        self.post_init()

    def _init_weights(self, module):
        pass  # the project model initialises itself; from_pretrained then loads the weights

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask=None, **kwargs):
        """Logits of every position from a zero state; with ``labels`` (not shifted, as in Hugging Face),
        the next-byte cross-entropy."""
        logits, _ = self.mlstm(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


AutoConfig.register(MODEL_TYPE, MLSTMHFConfig, exist_ok=True)
AutoModelForCausalLM.register(MLSTMHFConfig, MLSTMForCausalLM, exist_ok=True)
