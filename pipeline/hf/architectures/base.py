"""What every Hugging Face architecture module declares (``HFFamily``: its classes, its config's reader and
writer, what it cannot hold; ``WeightLayout``: its variant's tensor names) and the refusals they share.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.config import GPTConfig
from pipeline.hf.experts import ExpertNames
from pipeline.job.errors import UserError


class ConversionError(UserError, ValueError):
    """A model, config or state dict that cannot be converted exactly (the message says which field or tensor)."""


@dataclass(frozen=True)
class WeightRule:
    ours: str                      # project parameter name
    shape: tuple[int, ...]         # its full (TP=1) shape
    theirs: tuple[str, ...]        # Hugging Face tensor(s): several = row blocks of ``ours``, in order
    split: tuple[int, ...] = ()    # row counts of those blocks (when there are several)
    transpose: bool = False        # GPT-2 Conv1D: the HF tensor is ours transposed ([in, out])
    rope: tuple[int, int] = ()     # (RoPE rows, period): every period rows end with RoPE rows interleaved in HF's


@dataclass(frozen=True)
class WeightLayout:
    """A GPT variant's tensors in Hugging Face's files, which every family of the variant names alike."""
    rules: Callable[[GPTConfig, Callable[[], ExpertNames]], list[WeightRule]]  # (config, its family's expert names)
    prefix: str                  # the bare model's names inside the causal LM's ("transformer.", "model.")
    embedding: str               # the input embedding (a tied lm_head.weight in the files must equal it)
    always_biased: Callable[[GPTConfig], dict[str, int]] | None = None  # {name: rows}: biases the HF class always
    #                              has (GPT-2's Conv1D), which a bias-free project model exports as zeros


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face model family: its classes, its config's reader and writer, what of the project's
    config it cannot hold."""
    model_type: str
    variant: str                          # the project's GPT variant it maps to
    config_class: str                     # its transformers config class
    architecture: str                     # the causal-LM class an export names
    classifier: str                       # its *ForSequenceClassification (finetune.export_hf)
    base: str                             # the bare decoder class, whose weights import as well
    read: Callable[[Any, str], dict]      # (HF config, source) -> GPTConfig fields, refusing what it cannot hold
    write: Callable[[GPTConfig], dict]    # config -> the transformers config's fields (special tokens aside)
    holds: Callable[[GPTConfig], str | None]  # None, or what of the config the family cannot express
    experts: ExpertNames | None = None    # an MoE family's names of an MoE layer's tensors in its files
    imported: Callable[[Any, dict], dict] | None = None  # (HF config, its training record) -> fields beyond ``read``
    recorded: Callable[[Any], dict] | None = None  # HF config -> what config.extra["hf"] keeps for the export back

    @property
    def accepted(self) -> set[str]:
        return {self.architecture, self.base}


# DeepSeek-V3-generation settings (models/moe/router.py, models/deepseek.py) that change what the model computes and
# that none of the earlier families can express: their value in a config those families would otherwise export
LATER_GENERATION = {"moe_router_score_function": "softmax", "moe_router_num_groups": None,
                    "moe_router_group_topk": None, "moe_router_topk_scaling_factor": 1.0,
                    "moe_router_enable_expert_bias": False, "moe_shared_expert_intermediate_size": None,
                    "moe_shared_expert_gate": False, "multi_latent_attention": False, "mtp_num_layers": 0}


def differs(c: GPTConfig, wanted) -> list[str]:
    """``field=value`` of each (field, value) of ``wanted`` that the config does not have."""
    return [f"{name}={getattr(c, name)!r}" for name, value in wanted if getattr(c, name) != value]


def later_generation(c: GPTConfig) -> list[str]:
    return differs(c, LATER_GENERATION.items())


def holds(*, qkv_bias: bool = False, qk_norm: bool = False, sliding_window: bool = False, bias: bool = True,
          moe: bool = False, sparse_layers: bool = False):
    """A family's ``holds``: the settings of the config it cannot express, named as ``field=value``."""
    def problem(c: GPTConfig) -> str | None:
        lacks = later_generation(c)
        if (c.qkv_bias and not c.bias) != qkv_bias:  # Qwen2 always has Q, K, V biases, the others never alone
            lacks.append(f"qkv_bias={c.qkv_bias}")
        if c.qk_norm != qk_norm:
            lacks.append(f"qk_norm={c.qk_norm}")
        if c.sliding_window is not None and not sliding_window:
            lacks.append(f"sliding_window={c.sliding_window}")
        if c.bias and not bias:
            lacks.append("bias=True")
        if bool(c.num_experts) != moe:
            lacks.append(f"num_experts={c.num_experts}")
        elif moe and not sparse_layers and (c.moe_layer_freq != 1 or c.moe_dense_layers or not c.moe_norm_topk_prob):
            lacks.append(f"moe_layer_freq={c.moe_layer_freq}, moe_dense_layers={c.moe_dense_layers}, "
                         f"moe_norm_topk_prob={c.moe_norm_topk_prob} (every layer MoE, top-k renormalised)")
        return ", ".join(lacks) or None
    return problem


def refuse(source: str, field: str, value, wanted: str):
    raise ConversionError(f"{source}: {field}={value!r} cannot be represented by the project's model ({wanted})")
