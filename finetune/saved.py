"""A finetuned classifier on disk, and loading it back to classify texts.

Layout of a classifier directory (what ``finetune/train.py --save DIR`` writes)::

    classifier.json     encoder type + config, head config, labels, max length, tweet normalisation, pad id,
                        training settings; written last (a directory without it is incomplete)
    model.safetensors   the full TP=1 state dict: ``encoder.*`` (the GPT's names) and ``head.*``
    thresholds.json     tuned per-class thresholds (multilabel)
    tokenizer/          the tokenizer the classifier was trained with

    clf = load_classifier("runs/ec")               # one process, TP=1, fp32 on the CPU by default
    probs = clf.predict_proba(["so happy today!"]) # normalised, tokenised, batched by length
    preds = clf.predict(texts)                     # 0/1 at the tuned thresholds
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pipeline.job.errors import UserError
from models import GPTConfig, MLSTMConfig
from pipeline.data import load_saved_tokenizer
from pipeline.checkpoints.checkpoint import is_deepspeed_run_dir, read_full_model_state, refuse_other_model_kinds
from pipeline.job.families import family_named
from pipeline.checkpoints.model_dir import CONFIG_FILE, read_model_dir, tokenizer_dir_of
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.job.files import atomic_dir, atomic_path, crash_point

from ._io import atomic_write_text
from .batching import encode_texts, predict_encoded
from .heads import MULTILABEL, HeadConfig
from .model import ENCODER_PREFIX, BaseModelError, build_classifier
from .normalize import TweetNormalizer
from finetune.scoring.thresholds import THRESHOLDS_FILE, apply_thresholds, load_thresholds, save_thresholds

CLASSIFIER_FILE = "classifier.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "finetune.classifier/v1"


class ClassifierDirError(UserError, ValueError):
    pass


def save_classifier_dir(directory: str | os.PathLike, *, full_state: Mapping[str, torch.Tensor], encoder_type: str,
                        encoder_config, head_config: HeadConfig, tokenizer, max_length: int,
                        normalizer: TweetNormalizer | None, thresholds: Sequence[float] | None = None,
                        training: dict | None = None) -> Path:
    """Write a classifier directory. Complete-or-invisible: ``classifier.json`` is removed first and written
    last, every file atomically, so a reader never pairs new weights with an old description."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / CLASSIFIER_FILE).unlink(missing_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in full_state.items()}
    with atomic_path(d / WEIGHTS_FILE) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt", "content": FORMAT})
    names = head_config.label_names or tuple(f"label_{j}" for j in range(head_config.num_labels))
    if thresholds is not None:
        save_thresholds(d / THRESHOLDS_FILE, thresholds, names)
    with atomic_dir(d / "tokenizer", force=True) as tok_tmp:
        tokenizer.save(tok_tmp)
    pad_id = tokenizer.backend.token_to_id(tokenizer.pad_token) if tokenizer.pad_token else None
    info = {
        "format": FORMAT,
        "encoder_type": encoder_type,
        "encoder_config": encoder_config.to_dict(),
        "head_config": head_config.to_dict(),
        "label_names": list(names),
        "problem_type": head_config.problem_type,
        "max_length": int(max_length),
        "normalizer": None if normalizer is None else normalizer.to_dict(),
        "pad_id": int(pad_id if pad_id is not None else tokenizer.eod_id),
        "thresholds_file": THRESHOLDS_FILE if thresholds is not None else None,
        "training": training or {},
    }
    crash_point("before:classifier.json")
    atomic_write_text(d / CLASSIFIER_FILE, json.dumps(info, indent=2) + "\n")
    return d


def read_classifier_info(directory: str | os.PathLike) -> dict:
    """classifier.json with the configs as objects (``encoder_config``, ``head_config``, ``normalizer``)."""
    d = Path(directory)
    path = d / CLASSIFIER_FILE
    if not path.is_file():
        hint = " (an interrupted save?)" if (d / WEIGHTS_FILE).is_file() else ""
        raise ClassifierDirError(f"{d} is not a classifier directory: no {CLASSIFIER_FILE}{hint}")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ClassifierDirError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if info.get("format") != FORMAT:
        raise ClassifierDirError(f"{path}: format is {info.get('format')!r}, expected {FORMAT!r}")
    family = family_named(info.get("encoder_type"), str(path))
    info["encoder_config"] = family.config_class.from_dict(info["encoder_config"], source=str(path))
    try:
        info["head_config"] = HeadConfig.from_dict(info["head_config"])
        info["normalizer"] = None if info["normalizer"] is None else TweetNormalizer.from_dict(info["normalizer"])
    except ValueError as e:
        raise ClassifierDirError(f"{path}: {e}") from None
    return info


def read_classifier_dir(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(info, full state dict) of a classifier directory."""
    d = Path(directory)
    info = read_classifier_info(d)
    try:
        full = load_file(str(d / WEIGHTS_FILE))
    except FileNotFoundError:
        raise ClassifierDirError(f"{d} has no {WEIGHTS_FILE}") from None
    except Exception as e:
        raise ClassifierDirError(f"{d / WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    return info, full


@dataclass
class LoadedClassifier:
    """A classifier ready to classify raw texts the way it was trained (normalisation, tokenizer, max length)."""

    model: torch.nn.Module
    tokenizer: object
    info: dict
    thresholds: np.ndarray | None
    directory: Path

    @property
    def label_names(self) -> list[str]:
        return list(self.info["label_names"])

    @property
    def multilabel(self) -> bool:
        return self.info["problem_type"] == MULTILABEL

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        normalizer = self.info["normalizer"]
        texts = [normalizer(t) for t in texts] if normalizer is not None else list(texts)
        return encode_texts(self.tokenizer, texts, self.info["max_length"], self.info["head_config"].label_prompt)

    def predict_proba(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        return predict_encoded(self.model, self.encode(texts), self.info["pad_id"], batch_size=batch_size,
                               progress=progress)

    def predict(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """0/1 [n, k]: at the tuned thresholds (0.5 without them) for multilabel, one-hot argmax otherwise."""
        probs = self.predict_proba(texts, batch_size, progress)
        if self.multilabel:
            return apply_thresholds(probs, self.thresholds if self.thresholds is not None else 0.5)
        return np.eye(probs.shape[1], dtype=np.int8)[probs.argmax(axis=1)]


def load_classifier(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> LoadedClassifier:
    """A saved classifier in one process (TP=1), in eval mode."""

    d = Path(directory)
    info, full = read_classifier_dir(d)
    model = build_classifier(info["encoder_config"], info["head_config"], encoder_type=info["encoder_type"],
                             init_seed=0)
    load_full_state_dict(model, full, source=str(d / WEIGHTS_FILE))
    model = model.to(device=device, dtype=dtype).eval()
    thresholds = None
    if info.get("thresholds_file"):
        thresholds = load_thresholds(d / info["thresholds_file"], info["label_names"])
    return LoadedClassifier(model=model, tokenizer=load_saved_tokenizer(d / "tokenizer"), info=info,
                            thresholds=thresholds, directory=d)


# ------------------------------------------------------------------------------ full state dicts in

def load_base_state(directory: str | Path, *, lazy: bool = False
                    ) -> tuple[GPTConfig | MLSTMConfig, Mapping[str, torch.Tensor], Path | None]:
    """(model config, full TP=1 state dict, tokenizer directory or None) of a base model directory:

    * a project pretraining run (``config.json``, ``tokenizer/``, ``latest`` -> ``global_stepN/``) saved at any
      TP/PP layout, GPT or mLSTM (``pipeline.checkpoints.checkpoint.read_full_model_state``); a
      ``global_stepN`` directory picks that step;
    * ``config.json`` + ``model.safetensors`` (a full state dict: what ``pipeline.import_hf`` or
      ``models.save_mlstm`` writes; tokenizer files beside them or in tokenizer/);
    * a finetuned classifier directory (its encoder).

    Torch files are read with ``weights_only=True``. The tensors keep their stored dtype. ``lazy``: a model
    directory's weights are read one tensor at a time when asked for (a read-only mapping), so a model built
    beside them is not held twice; the other forms are read whole."""
    d = Path(directory)
    if not d.exists():
        raise BaseModelError(f"base model directory {d} does not exist")
    if not d.is_dir():
        raise BaseModelError(f"base model {d} is a file; give its directory")
    if d.name.startswith("global_step") and (d.parent / CONFIG_FILE).is_file():
        return read_full_model_state(d.parent, d.name)
    refuse_other_model_kinds(d, allow=(CLASSIFIER_FILE,))  # an ensemble, a TF-IDF model, a Hugging Face model
    if (d / CLASSIFIER_FILE).is_file():
        info, full = read_classifier_dir(d)
        encoder = {k[len(ENCODER_PREFIX):]: v for k, v in full.items() if k.startswith(ENCODER_PREFIX)}
        return info["encoder_config"], encoder, tokenizer_dir_of(d)
    if (d / WEIGHTS_FILE).is_file():
        if not (d / CONFIG_FILE).is_file():
            raise BaseModelError(f"{d} has {WEIGHTS_FILE} but no {CONFIG_FILE} (the model config)")
        return read_model_dir(d, lazy=lazy)
    if is_deepspeed_run_dir(d):
        return read_full_model_state(d)
    found = ", ".join(sorted(p.name for p in d.iterdir())[:12]) or "nothing"
    raise BaseModelError(f"{d} is not a base model directory: expected {CONFIG_FILE} with {WEIGHTS_FILE}, a "
                         f"pretraining checkpoint (latest, global_stepN/) or a classifier ({CLASSIFIER_FILE}); "
                         f"found: {found}")


def load_full_gpt_state(directory: str | Path, *, lazy: bool = False
                        ) -> tuple[GPTConfig, Mapping[str, torch.Tensor], Path | None]:
    """``load_base_state`` for a GPT base model (refuses any other)."""
    config, full, tokenizer_dir = load_base_state(directory, lazy=lazy)
    if not isinstance(config, GPTConfig):
        raise BaseModelError(f"{directory} holds a {type(config).__name__} model, not a GPT")
    return config, full, tokenizer_dir
