"""Loading the models to score: Hugging Face directories / GGUF files, and the project's own model directories."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import models.hf_mlstm  # noqa: F401  (registers the project's mLSTM with the Auto classes, for --hf of its export)
from models.parallel import initialize_model_parallel
from pipeline.checkpoints import safe_load
from pipeline.checkpoints.checkpoint import read_full_checkpoint
from pipeline.job.errors import InputError
from pipeline.job.families import family_of
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import check_gguf, check_weight_headers

from pipeline.evaluation.lm_scoring.scoring import HFScorer
from pipeline.evaluation.lm_scoring.tokenization import HFTokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _split_gguf(path: Path) -> tuple[Path, str | None]:
    """(directory, GGUF file name or None) for a model directory or a ``.gguf`` file."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{path} is a file but not a .gguf file; pass a Hugging Face model directory "
                             f"or a GGUF file")
        return check_gguf(path).parent, path.name
    if not path.is_dir():
        raise FileNotFoundError(f"no Hugging Face model directory or GGUF file at {path}")
    return path, None


def load_hf_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> HFTokenizer:
    directory, gguf = _split_gguf(Path(path))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf, trust_remote_code=trust_remote_code)
    return HFTokenizer(tok, name=str(path))


def load_hf_model(path: str | Path, *, dtype: str = "fp32", device: str | None = None,
                  trust_remote_code: bool = False) -> tuple[HFScorer, dict]:
    """A causal LM from a local Hugging Face directory or GGUF file, as a scorer, plus a description.

    A model's own Python code runs only when the caller opts in (``trust_remote_code``); nothing is downloaded.
    """
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    directory, gguf = _split_gguf(Path(path))
    safe_load.scan_weight_files(directory)
    if gguf is None:
        check_weight_headers(directory)
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=DTYPES[dtype],
                                                 trust_remote_code=trust_remote_code, local_files_only=True)
    model.to(dev)
    scorer = HFScorer(model)
    info = {"source": str(path), "format": "gguf" if gguf else "hf", "class": type(model).__name__,
            "model_type": getattr(model.config, "model_type", None),
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype, "device": str(dev),
            "max_positions": scorer.max_positions}
    return scorer, info


def load_project_model(checkpoint_dir: str | Path, tensor_parallel: int = 1, tokenizer: str | Path | None = None,
                       context_parallel: int = 1):
    """A project model directory -> (the model with this rank's shards, tokenizer).

    Any directory ``pipeline.checkpoints.checkpoint.read_full_checkpoint`` reads: a pretraining run (DeepSpeed
    checkpoints saved at any TP/PP/DP layout, GPT or mLSTM), one of its ``global_step<N>`` tags, or a
    ``config.json`` + ``model.safetensors`` directory. The full weights are re-cut for ``tensor_parallel``
    (pipeline stages are not needed to score); ``context_parallel`` splits each window over that many ranks
    (DeepSpeed-Ulysses, attention models only); the data-parallel size is what is left of the launched world.
    The model family (``pipeline.job.families``) builds the model, and refuses a TP size it lacks; its scorer is
    ``project_scorer(model)``.
    ``tokenizer``: a tokenizer directory or .gguf file to use instead of the directory's own.
    Called on every rank after ``pipeline.engine.distributed.init_distributed()``.
    """
    # the parallel state first: reading a checkpoint builds a meta-device model for its ShardSpecs, which
    # needs one once several ranks are launched
    initialize_model_parallel(tensor_parallel, 1, context_parallel)
    config, full, tokenizer_dir = read_full_checkpoint(checkpoint_dir, lazy=True)
    family = family_of(config)
    family.check_layout(config, tensor_parallel, 1, context_parallel)  # the layout's rules (pipeline.job.layout)
    tokenizer_dir = tokenizer or tokenizer_dir
    if tokenizer_dir is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no tokenizer; pass --tokenizer")
    return build_filled(family, config, full, str(checkpoint_dir)).eval(), load_hf_tokenizer(tokenizer_dir)


def build_filled(family, config, full, source: str) -> torch.nn.Module:
    """The model built on the meta device (no random initialisation, no memory), then given real storage and
    filled from ``full`` tensor by tensor: with a lazy ``full`` the weights are in memory once."""
    with torch.device("meta"):
        model = family.build(config, 0)
    # to_empty makes new Parameter objects: carry over what the layers attached to theirs (ShardSpec, TP marks)
    marks = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        p.__dict__.update(marks[name])
    load_full_state_dict(model, full, source=source)
    return model


def project_scorer(model):
    """The scorer the model's family registers (GPTScorer, MLSTMScorer)."""
    return family_of(model.config).get("scorer")(model)
