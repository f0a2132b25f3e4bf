"""Export a trained model to a Hugging Face directory that ``from_pretrained`` loads without custom code.

    python -m pipeline.export_hf --checkpoint DIR --out DIR [--dtype float32|float16|bfloat16]
                                 [--tokenizer DIR] [--force] [--verify]

The output holds safetensors weights, ``config.json``, ``generation_config.json`` and
the tokenizer files. It is written into a temporary directory beside ``--out`` and
renamed into place when complete. ``--verify`` reloads the export with transformers
and compares its logits with the project model's.

Each kind of model exports through one small function registered with
``@exporter(ConfigType)`` (config + full state dict -> ``HFExport``); the directory
writing, tokenizer and verification are shared.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from models.config import GPTConfig
from models.mlstm import MLSTMConfig
from pipeline.errors import ArgumentParser, add_debug_arg, command
from pipeline.hf_convert import (HF_ARCHITECTURE, ConversionError, dtype_name, num_parameters_message, parse_dtype,
                                 to_hf)
from pipeline.files import atomic_dir, check_output_dir, refuse_overlap
from pipeline.state_dicts import read_state_dict

# Files a Hugging Face tokenizer directory may hold; those present are copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass
class HFExport:
    config: Any                        # a transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    generation_config: Any = None      # a transformers GenerationConfig, for generative models


Exporter = Callable[..., HFExport]
EXPORTERS: dict[type, Exporter] = {}


def exporter(config_type: type):
    """Register ``fn(config, full_state_dict, dtype, special_tokens) -> HFExport`` for one model config type."""
    def register(fn: Exporter) -> Exporter:
        EXPORTERS[config_type] = fn
        return fn
    return register


@exporter(MLSTMConfig)
def export_mlstm(config: MLSTMConfig, full_sd: Mapping[str, torch.Tensor], dtype, special_tokens) -> HFExport:
    """-> MLSTMForCausalLM (models/hf_mlstm.py), which ``import models.hf_mlstm`` registers with the Auto classes."""
    from models.hf_mlstm import MLSTMHFConfig
    cfg = MLSTMHFConfig.from_project(config, **{k: v for k, v in special_tokens.items() if v is not None})
    cfg.architectures = ["MLSTMForCausalLM"]
    sd = {f"mlstm.{k}": (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in full_sd.items()}
    return HFExport(cfg, sd)


@exporter(GPTConfig)
def export_gpt(config: GPTConfig, full_sd: Mapping[str, torch.Tensor], dtype, special_tokens) -> HFExport:
    from transformers import GenerationConfig
    cfg, sd = to_hf(full_sd, config, dtype, special_tokens)
    gen = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                           pad_token_id=cfg.pad_token_id)
    return HFExport(cfg, sd, gen)


# -- the project's model directory (what import_hf writes) --------------------------------------------------------------

def read_model_dir(path: str | Path):
    """(config, full state dict, tokenizer directory or None) of a directory of config.json + model.safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise FileNotFoundError(f"checkpoint directory {path} has no {WEIGHTS_FILE} (found: {found})")
    config = GPTConfig.from_file(path / CONFIG_FILE)
    return config, dict(read_state_dict(weights)), (path if has_tokenizer(path) else None)


def read_full_checkpoint(path):
    from .checkpoint import read_full_checkpoint as read_any
    return read_any(path)


# -- tokenizer -------------------------------------------------------------------------------------------------------

def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def copy_tokenizer_files(src: str | Path, dst: Path) -> list[str]:
    src = Path(src)
    names = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not names:
        raise FileNotFoundError(f"tokenizer directory {src} holds none of {', '.join(TOKENIZER_FILES[:6])}, ...")
    for name in names:
        shutil.copy2(src / name, dst / name)
    return names


def _tokenizer_special_tokens(tokenizer_dir: Path, vocab_size: int, source) -> dict:
    """Load the copied tokenizer as a user will (AutoTokenizer), check it fits the model, read its special ids."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a bad tokenizer directory
        raise ConversionError(f"the tokenizer files of {source} do not load with AutoTokenizer: {e}") from None
    if len(tok) > vocab_size:
        raise ConversionError(f"the tokenizer in {source} has {len(tok)} tokens but the model's vocabulary has {vocab_size}: "
                              f"this tokenizer does not belong to this model")
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


# -- writing ----------------------------------------------------------------------------------------------------------

def export_hf(config, full_sd: Mapping[str, torch.Tensor], out: str | Path, *, dtype=None,
              tokenizer_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write the Hugging Face directory of the model ``(config, full_sd)`` to ``out`` (atomically)."""
    from huggingface_hub import save_torch_state_dict
    try:
        make = EXPORTERS[type(config)]
    except KeyError:
        raise ConversionError(f"no Hugging Face exporter for {type(config).__name__}; "
                              f"known: {', '.join(t.__name__ for t in EXPORTERS)}") from None
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
        save_torch_state_dict(export.state_dict, tmp)
        if export.generation_config is not None:
            export.generation_config.save_pretrained(tmp)
    return out


# -- verification ---------------------------------------------------------------------------------------------------

def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the measure every logit comparison in this project reports."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@torch.no_grad()
def compare_with_hf(config: GPTConfig, full_sd: Mapping[str, torch.Tensor], hf_dir: str | Path,
                    tokens: torch.Tensor | None = None) -> float:
    """Max relative logit difference between the exported model and the project model (both TP=1, fp32).

    The project model gets the weights rounded to the exported dtype, so that only the
    mapping is measured, not the rounding of a half-precision export.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from models import GPT
    from pipeline.state_dicts import load_full_state_dict
    exported_dtype = parse_dtype(dtype_name(AutoConfig.from_pretrained(str(hf_dir)).dtype))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model = GPT(config).eval()
    load_full_state_dict(model, {k: v.to(exported_dtype or v.dtype).float() for k, v in full_sd.items()})
    if tokens is None:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (2, min(16, config.max_position_embeddings)), generator=g)
    return max_relative_difference(hf(tokens).logits, model(tokens))


# -- command line -------------------------------------------------------------------------------------------------------

@command
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m pipeline.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory to export")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"],
                   help="dtype of the exported weights (default float32)")
    p.add_argument("--tokenizer", help="directory of Hugging Face tokenizer files (default: the checkpoint's own)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--verify", action="store_true",
                   help="reload the export with transformers and compare its logits with the project model's")
    add_debug_arg(p)
    args = p.parse_args(argv)
    refuse_overlap(args.out, [("--checkpoint", args.checkpoint), ("--tokenizer", args.tokenizer)])
    check_output_dir(args.out, args.force)  # before reading the checkpoint
    config, full_sd, tokenizer_dir = read_full_checkpoint(args.checkpoint)
    tokenizer_dir = args.tokenizer or tokenizer_dir
    out = export_hf(config, full_sd, args.out, dtype=args.dtype, tokenizer_dir=tokenizer_dir, force=args.force)
    arch = HF_ARCHITECTURE.get(getattr(config, "variant", None), type(config).__name__)
    print(f"exported {arch} ({num_parameters_message(config)}, {dtype_name(parse_dtype(args.dtype))}) to {out}"
          + ("" if tokenizer_dir else " (no tokenizer: pass --tokenizer DIR to include one)"))
    if args.verify:
        diff = compare_with_hf(config, full_sd, out)
        print(f"verify: max relative logit difference {diff:.2e}")
        if diff > 1e-4:
            print("verify: FAILED (more than 1e-4)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
