"""The model-family registry: everything the commands need to know about a kind of model, in one entry.

    family = family_of(config)             # or family_named("mlstm"), family_of_dict(config_json)
    family.check_layout(config, tp, pp)     # refuses a layout the family cannot train or score at
    model = family.build(config, init_seed)
    exporter = family.get("hf_exporter")    # pipeline.export_hf's function for this family

In the spirit of torchtitan's ModelSpec. An entry names its config class, its builders, the layouts it
supports, how its checkpoint shards join (``shard_specs``), its Hugging Face exporter and verifier,
its evaluation scorer and its finetuning encoder. Functions that live in higher layers (pipeline.export_hf,
pipeline.evaluation.lm_scoring, finetune.model) are named as ``"module:attribute"`` and resolved on first use, so this
module imports no command and no command module imports another to dispatch. A new family is one entry
here (and its model in models/); no command branches on ``model_type``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from models import GPT, MLSTM, GPTConfig, MLSTMConfig
from models.config import ConfigError
from models.parallel import Layout, get_parallel_state, get_shard_spec
from pipeline.job.layout import LayoutCheck, validate


@dataclass(frozen=True)
class ModelFamily:
    name: str                       # the config's "model_type"
    config_class: type
    default_preset: str             # models/configs/<preset>.json when none is given
    default_tokenizer: str          # what pipeline.data.load_tokenizer builds when none is given
    layouts: str                    # the parallel layouts it trains at, in words (for refusals)
    build_module: Callable          # (config, init_seed, layout) -> the module at this rank's shard of the layout
    stream_data: bool               # truncated BPTT over contiguous streams (else shuffled packed sequences)
    pipeline_parallel_capable: bool  # trains with pipeline parallelism (pipeline/engine/pipe_model.py)
    tensor_parallel_capable: bool
    # "hf_exporter", "hf_verifier", "scorer", "encoder", "decoder", "hf_classifier" (a finetuned classifier -> HF)
    refs: dict[str, str] = field(default_factory=dict)

    def get(self, what: str) -> Any:
        """The function or class registered under ``what`` (imported on first use)."""
        try:
            module, _, attr = self.refs[what].partition(":")
        except KeyError:
            raise ConfigError(f"the {self.name} model family has no {what.replace('_', ' ')}; "
                              f"it has {', '.join(self.refs) or 'none'}") from None
        return getattr(importlib.import_module(module), attr)

    def build(self, config, init_seed: int | None = None, layout: Layout | None = None) -> torch.nn.Module:
        """The model at ``layout`` (default: the current process groups')."""
        return self.build_module(config, init_seed, layout)

    def build_for_training(self, config, init_seed: int | None = None) -> torch.nn.Module:
        """``build``; a stream model keeps its TBPTT state between calls, so the engine's forward stays
        (inputs, labels)."""
        model = self.build(config, init_seed)
        if self.stream_data:
            model.carry_state = True
        return model

    def check_layout(self, config, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                     context_parallel: int = 1) -> None:
        """Raise ``LayoutError`` when the family (or this config) cannot be split as (TP, PP, CP): the layout rules
        (``pipeline.job.layout``) of a model that is scored, generated from or imported."""
        validate(LayoutCheck(Layout(tensor=tensor_parallel, pipeline=pipeline_parallel, context=context_parallel),
                             config, self))

    def shard_specs(self, config) -> dict:
        """{parameter name: ShardSpec or None} of the full state dict, from a model built on the meta device (with
        every expert: a full state dict names them all, whatever this rank's expert-parallel size)."""
        with torch.device("meta"):
            model = self.build(config, 0, get_parallel_state().layout.replace(expert=1))
        return {name: get_shard_spec(p) for name, p in model.named_parameters()}


def _build_gpt(config: GPTConfig, init_seed: int | None, layout: Layout | None = None) -> GPT:
    return GPT(config, init_seed=init_seed, layout=layout)


def _build_mlstm(config: MLSTMConfig, init_seed: int | None, layout: Layout | None = None) -> MLSTM:
    """The same initial weights on every data-parallel rank, without touching the global RNG streams."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed or 0)
        return MLSTM(config)


FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.name] = family
    return family


register(ModelFamily(
    name="gpt", config_class=GPTConfig, default_preset="gpt2-tiny", default_tokenizer="train-bpe",
    layouts="tensor, pipeline and data parallelism", build_module=_build_gpt, stream_data=False,
    pipeline_parallel_capable=True, tensor_parallel_capable=True,
    refs={"hf_exporter": "pipeline.hf.export:export_gpt", "hf_verifier": "pipeline.hf.export:gpt_logits",
          "scorer": "pipeline.evaluation.lm_scoring.scoring:GPTScorer", "encoder": "finetune.model:GPTEncoder",
          "decoder": "pipeline.generation.decoders:GPTDecoder",
          "hf_classifier": "finetune.hf_export:classifier_to_hf"}))

register(ModelFamily(
    name="mlstm", config_class=MLSTMConfig, default_preset="mlstm-tiny", default_tokenizer="bytes",
    layouts="data parallelism (and ZeRO)", build_module=_build_mlstm, stream_data=True,
    pipeline_parallel_capable=False, tensor_parallel_capable=False,
    refs={"hf_exporter": "pipeline.hf.export:export_mlstm", "hf_verifier": "pipeline.hf.export:mlstm_logits",
          "scorer": "pipeline.evaluation.lm_scoring.scoring:MLSTMScorer", "encoder": "finetune.model:MLSTMEncoder",
          "decoder": "pipeline.generation.decoders:MLSTMDecoder"}))


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
