"""The model-family registry: everything the commands need to know about a kind of model, in one entry.

    family = family_of(config)             # or family_named("mlstm"), family_of_dict(config_json)
    family.check_layout(config, tp, pp)     # refuses a layout the family cannot train or score at
    model = family.build(config, init_seed)
    exporter = family.hf_exporter           # the family's Hugging Face exporter (or family.get(...))

Each family is one folder, ``pipeline/families/<family>/``: its ``FAMILY`` entry (``pipeline.families.spec``), its
model-side parts (scorer, decoder, encoder) and its Hugging Face exporter and verifier, as real callables over its
model in models/. A new family is that folder, its model, and one ``register`` line here; nothing here names a
higher layer (finetune, a command), no import is deferred to a "module:attribute" string and no command branches on
``model_type``.
"""
from __future__ import annotations

from models.config import ConfigError
from pipeline.families import gpt, mlstm
from pipeline.families.spec import PARTS, ModelFamily, PipelineNames

__all__ = ["PARTS", "ModelFamily", "PipelineNames", "FAMILIES", "register", "family_named", "family_of",
           "family_of_dict", "config_from_dict"]

FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.name] = family
    return family


register(gpt.FAMILY)
register(mlstm.FAMILY)


def family_named(name: str, source: str = "model config") -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"{source}: unknown model_type {name!r}; known: {', '.join(FAMILIES)}") from None


def family_of(config) -> ModelFamily:
    """The family of a config object (GPTConfig, MLSTMConfig, ...)."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_class):
            return family
    raise ConfigError(f"no model family for a {type(config).__name__}; known: {', '.join(FAMILIES)}")


def family_of_dict(raw: dict, source: str = "model config") -> ModelFamily:
    """The family of a config.json's contents (``model_type``, default gpt)."""
    return family_named(raw.get("model_type", "gpt"), source)


def config_from_dict(raw: dict, source: str = "model config"):
    return family_of_dict(raw, source).config_class.from_dict(raw, source=source)
