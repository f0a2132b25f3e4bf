"""What the LoRA flags become (PEFT's ``LoraConfig``, the settings a run records). The argument groups of the
language-model finetuning commands and of LoRA are in ``finetune.lm.job.arguments`` (no torch, no PEFT: a parser
builds without them) and re-exported here.
"""
from __future__ import annotations

from peft import LoraConfig

from finetune.lm.job.arguments import (DEFAULT_RANK, DEFAULT_TARGETS,  # noqa: F401 (the groups: re-exported)
                                       add_lora_args, add_post_training_args, post_training_parser)


def lora_from_args(args, base: str | None = None, task_type: str | None = None) -> LoraConfig | None:
    """PEFT's ``LoraConfig`` of the LoRA flags, or None (a full finetune) when none is given."""
    r, alpha, dropout, targets = (getattr(args, f"lora_{k}", None) for k in ("r", "alpha", "dropout",
                                                                           "target_modules"))
    if not getattr(args, "lora", False) and all(v is None for v in (r, alpha, dropout, targets)):
        return None  # (also a Namespace made without the LoRA group)
    rank = r or DEFAULT_RANK
    targets = targets or DEFAULT_TARGETS
    targets = targets[0] if isinstance(targets, list) and targets == [DEFAULT_TARGETS] else targets
    return LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout or 0.0,
                      target_modules=targets, base_model_name_or_path=base, task_type=task_type)


def lora_settings(lora: LoraConfig | None, targets) -> dict | None:
    """What a run records of its LoRA (an interrupted run continues only with the same)."""
    if lora is None:
        return None
    return {"r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
            "target_modules": sorted(t.hf_module for t in targets)}
