"""A trained model as a Hugging Face directory that ``from_pretrained`` loads without custom code
(``python -m pipeline.export_hf``): safetensors weights, ``config.json``, ``generation_config.json`` and the
tokenizer files, written into a temporary directory and renamed into place when complete.

Each model family exports through one small function that its spec in ``pipeline.job.families`` holds
(config + full state dict -> ``HFExport``, ``pipeline/families/<family>/hf.py``) and verifies through another
(the project model's logits); the directory writing, tokenizer and verification are shared.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import models.hf_mlstm  # noqa: F401  importing it registers the mLSTM with the Auto classes
from pipeline.hf.convert import ConversionError, dtype_name, parse_dtype
from pipeline.hf.exporters import HFExport
from pipeline.job.families import family_of
from pipeline.job.files import atomic_dir
from pipeline.checkpoints.model_dir import copy_tokenizer_files
from pipeline.hf.safetensors_io import write_hf_weights


# -- tokenizer -------------------------------------------------------------------------------------------------------

def _tokenizer_special_tokens(tokenizer_dir: Path, vocab_size: int, source) -> dict:
    """Load the copied tokenizer as a user will (AutoTokenizer), check it fits the model, read its special ids."""
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a bad tokenizer directory
        raise ConversionError(f"the tokenizer files of {source} do not load with AutoTokenizer: {e}") from None
    if len(tok) > vocab_size:
        raise ConversionError(f"the tokenizer in {source} has {len(tok)} tokens but the model's vocabulary has "
                              f"{vocab_size}: "
                              f"this tokenizer does not belong to this model")
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


__all__ = ["HFExport", "export_hf", "compare_with_hf", "max_relative_difference"]


# -- writing ----------------------------------------------------------------------------------------------------------

def export_hf(config, full_sd: Mapping[str, torch.Tensor], out: str | Path, *, dtype=None,
              tokenizer_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write the Hugging Face directory of the model ``(config, full_sd)`` to ``out`` (atomically)."""
    make = family_of(config).get("hf_exporter")
    out = Path(out)
    with atomic_dir(out, force=force) as tmp:
        special = {}
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
            found = _tokenizer_special_tokens(tmp, config.vocab_size, tokenizer_dir)
            recorded = config.extra.get("hf", {}) if isinstance(getattr(config, "extra", None), dict) else {}
            special = {k: recorded.get(k) if recorded.get(k) is not None else v for k, v in found.items()}
        export = make(config, full_sd, parse_dtype(dtype), special)
        export.config.save_pretrained(tmp)
        write_hf_weights(tmp, export.state_dict)
        if export.generation_config is not None:
            export.generation_config.save_pretrained(tmp)
    return out


# -- verification ---------------------------------------------------------------------------------------------------

def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the measure every logit comparison in this project reports."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@torch.no_grad()
def compare_with_hf(config, full_sd: Mapping[str, torch.Tensor], hf_dir: str | Path,
                    tokens: torch.Tensor | None = None) -> float:
    """Max relative logit difference between the exported model and the project model (both TP=1, fp32).

    The project model gets the weights rounded to the exported dtype, so that only the
    mapping is measured, not the rounding of a half-precision export.
    """
    exported_dtype = parse_dtype(dtype_name(AutoConfig.from_pretrained(str(hf_dir)).dtype or torch.float32))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    rounded = {k: v.to(exported_dtype or v.dtype).float() if v.is_floating_point() else v for k, v in full_sd.items()}
    if tokens is None:
        g = torch.Generator().manual_seed(0)
        length = min(16, getattr(config, "max_position_embeddings", None) or config.seq_length)
        tokens = torch.randint(0, config.vocab_size, (2, length), generator=g)
    return max_relative_difference(hf(tokens).logits, family_of(config).get("hf_verifier")(config, rounded, tokens))
