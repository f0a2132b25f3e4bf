"""Model configs as a user names them: a JSON file or a preset of ``models/configs/``, resolved to the family's
config class, its vocabulary following the tokenizer."""
from __future__ import annotations

from pathlib import Path

from models import ConfigError
from pipeline.job.arguments import (add_model_args, check_recompute_args,  # noqa: F401 (re-exported)
                                    recompute_modules_arg)
from pipeline.job.errors import UserError
from pipeline.job.families import family_named, family_of_dict
from pipeline.job.files import read_json_object

PRESETS = Path(__file__).resolve().parents[2] / "models" / "configs"
_EMBEDDING_ROWS = "_vocab_size_of_the_weights"  # a raw config's mark: read from the --load directory


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def read_model_config(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file() and (PRESETS / f"{spec}.json").is_file():
        path = PRESETS / f"{spec}.json"
    if not path.is_file():
        raise ConfigError(f"model config {spec!r} is neither a file nor a preset ({', '.join(presets())})")
    return {"_source": str(path), **read_json_object(path, "--model-config")}


def choose_model_config(spec: str | None, model_type: str | None, load_dir: Path | None):
    """(raw config, family) of ``--model-config`` (default: the loaded run's config, else the family's preset),
    checked against ``--model-type``."""
    if load_dir is not None and not (load_dir / "config.json").is_file():
        if not load_dir.exists():
            raise UserError(f"--load {load_dir}: no such directory; give the --save directory of an earlier run")
        raise UserError(f"--load {load_dir}: not a run directory (no config.json, latest or global_step*/ in it); "
                        f"give the --save directory of an earlier run, or a model directory (config.json + "
                        f"model.safetensors, e.g. from pipeline.import_hf)")
    weights_config = spec is None and load_dir is not None
    if spec is None:
        spec = (str(load_dir / "config.json") if load_dir is not None
                else family_named(model_type or "gpt").default_preset)
    raw = read_model_config(spec)
    if weights_config:  # the loaded weights' embedding fixes vocab_size: a tokenizer whose ids fit it will do
        raw[_EMBEDDING_ROWS] = True
    family = family_of_dict(raw, raw["_source"])
    if model_type is not None and model_type != family.name:
        raise UserError(f"--model-type {model_type} but {raw['_source']} is a {family.name} config; "
                        f"drop --model-type or choose another config")
    return raw, family


def make_model_config(raw: dict, vocab_size: int, seq_length: int | None):
    """The family's config class (by the config's model_type), its vocabulary following the tokenizer."""
    raw = dict(raw)
    source = raw.pop("_source", "model config")
    fixed_rows = raw.pop(_EMBEDDING_ROWS, False) and raw.get("vocab_size", 0) >= vocab_size
    family = family_of_dict(raw, source)
    if fixed_rows:  # the loaded model's embedding (tokenizer_for_bare_model said which rows go unused)
        vocab_size = raw["vocab_size"]
    if raw.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"{source}: vocab_size {raw['vocab_size']} differs from the tokenizer's {vocab_size}; "
                          f"drop vocab_size from the config (it follows the tokenizer) or use the matching tokenizer")
    raw["vocab_size"] = vocab_size
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return family.config_class.from_dict(raw, source=source)


def preview_model_config(raw: dict, seq_length: int | None):
    """The model config as far as it is known before the tokenizer is (its own vocabulary, or the class
    default): what the layout rules read (heads, sequence, layers, experts) before any work starts."""
    source = raw.get("_source", "model config")
    raw = {k: v for k, v in raw.items() if k not in ("_source", _EMBEDDING_ROWS)}
    family = family_of_dict(raw, source)
    if seq_length is not None:
        raw["seq_length"] = seq_length
    return family.config_class.from_dict(raw, source=source)
