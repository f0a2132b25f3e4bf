"""The project's model directories: ``config.json`` + ``model.safetensors`` (+ tokenizer files), one tokenizer rule.

    config, full_state_dict, tokenizer_dir = read_model_dir(path)     # GPT or mLSTM (by config.json's model_type)
    write_model_dir(config, full_state_dict, out, tokenizer=..., force=False)
    tokenizer_dir_of(path)                                           # where a directory's tokenizer is, or None

What ``pipeline.import_hf`` and ``models.save_mlstm`` write. A pretraining run (DeepSpeed checkpoints) is read by
``pipeline.checkpoints.checkpoint.read_full_checkpoint``, which falls back to this module for such a directory;
a finetuned classifier by ``finetune.saved``. The tokenizer rule, for all of them: ``<dir>/tokenizer/`` when it
holds tokenizer files, else ``<dir>`` itself when it does, else none.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from models.config import read_config_json
from pipeline.job.families import config_from_dict
from pipeline.job.files import atomic_dir
from pipeline.checkpoints.state_dicts import read_state_dict, save_state_dict

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# Files a Hugging Face tokenizer directory may hold; those present are copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_dir_of(path: str | Path) -> Path | None:
    path = Path(path)
    for candidate in (path / "tokenizer", path):
        if has_tokenizer(candidate):
            return candidate
    return None


def copy_tokenizer_files(src: str | Path, dst: Path) -> list[str]:
    src = Path(src)
    names = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not names:
        raise FileNotFoundError(f"tokenizer directory {src} holds none of {', '.join(TOKENIZER_FILES[:6])}, ...")
    for name in names:
        shutil.copy2(src / name, dst / name)
    return names


def read_model_dir(path: str | Path, *, lazy: bool = False):
    """(config, full state dict, tokenizer directory or None) of a directory of config.json + model.safetensors.

    ``lazy``: the state dict reads each tensor when it is asked for (for conversions and loads that take one
    tensor at a time and must not hold the model twice)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise FileNotFoundError(f"checkpoint directory {path} has no {WEIGHTS_FILE} (found: {found})")
    config = config_from_dict(read_config_json(path / CONFIG_FILE), str(path / CONFIG_FILE))
    return config, read_state_dict(weights, lazy=lazy), tokenizer_dir_of(path)


def write_model_dir(config, full_sd, out: str | Path, *, tokenizer=None, force: bool = False) -> Path:
    """The project's model directory: config.json, model.safetensors (full TP=1 state dict), tokenizer files.

    ``tokenizer`` is a directory of tokenizer files (copied) or a loaded transformers tokenizer (saved).
    Written atomically; read back by ``read_model_dir``.
    """
    with atomic_dir(out, force=force) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        save_state_dict(full_sd, tmp / WEIGHTS_FILE)
        if isinstance(tokenizer, (str, Path)):
            copy_tokenizer_files(tokenizer, tmp)
        elif tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out)
