"""What a model family's Hugging Face exporter returns (``HFExport``: a transformers config, the state dict under
its names, a generation config); each family's exporter and verifier live in its folder
(``pipeline/families/<family>/hf.py``), and ``pipeline.hf.export`` writes and verifies the directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class HFExport:
    config: Any                        # a transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    generation_config: Any = None      # a transformers GenerationConfig, for generative models
