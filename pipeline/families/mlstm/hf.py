"""The mLSTM family's Hugging Face exporter (-> ``MLSTMForCausalLM``, models/hf_mlstm.py) and verifier (the project
model's logits); ``pipeline.hf.export`` writes and verifies the directory."""
from __future__ import annotations

from typing import Mapping

import torch

from models import MLSTM
from models.mlstm import MLSTMConfig
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.exporters import HFExport


def export_mlstm(config: MLSTMConfig, full_sd: Mapping[str, torch.Tensor], dtype, special_tokens) -> HFExport:
    """-> MLSTMForCausalLM (models/hf_mlstm.py), which ``import models.hf_mlstm`` registers with the Auto classes."""
    from models.hf_mlstm import MLSTMHFConfig  # noqa: PLC0415  transformers (seconds to import) only to export
    cfg = MLSTMHFConfig.from_project(config, **{k: v for k, v in special_tokens.items() if v is not None})
    cfg.architectures = ["MLSTMForCausalLM"]
    cfg.dtype = dtype or torch.float32
    sd = {f"mlstm.{k}": (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in full_sd.items()}
    return HFExport(cfg, sd)


def mlstm_logits(config: MLSTMConfig, full_sd: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    model = MLSTM(config).eval()
    load_full_state_dict(model, full_sd)
    return model(tokens)[0]
