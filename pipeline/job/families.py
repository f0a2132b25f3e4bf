"""The model-family registry: everything the commands need to know about a kind of model, in one entry.

    family = family_of(config)             # or family_named("mlstm"), family_of_dict(config_json)
    family.check_layout(config, tp, pp)     # refuses a layout the family cannot train or score at
    model = family.build(config, init_seed)
    exporter = family.hf_exporter           # pipeline.export_hf's function for this family (or family.get(...))

In the spirit of torchtitan's ModelSpec. An entry holds, as real callables, its config class, its builders, the
layouts it supports, how its checkpoint shards join (``shard_specs``), its Hugging Face exporter and verifier
(``pipeline.hf.exporters``), and its evaluation scorer, generation decoder and finetuning encoder
(``models.families.<family>``). The family-specific pieces are model-side
code or HF conversion, below this module, so the spec imports them directly: nothing here names a higher layer
(finetune, a command) and no import is deferred to a "module:attribute" string. A new family is one entry here
(and its model in models/); no command branches on ``model_type``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models import GPT, MLSTM, GPTConfig, MLSTMConfig
from models.config import ConfigError
from models.families.gpt import GPTDecoder, GPTEncoder, GPTScorer
from models.families.mlstm import MLSTMDecoder, MLSTMEncoder, MLSTMScorer
from models.parallel import Layout, get_parallel_state, get_shard_spec
from pipeline.hf.exporters import export_gpt, export_mlstm, gpt_logits, mlstm_logits
from pipeline.job.layout import LayoutCheck, validate

# the family parts ``ModelFamily.get`` hands out by name
PARTS = ("hf_exporter", "hf_verifier", "scorer", "encoder", "decoder")


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
    hf_exporter: Callable | None = None  # (config, full state dict, dtype, special tokens) -> pipeline.hf HFExport
    hf_verifier: Callable | None = None  # (config, full state dict, tokens) -> the project model's logits
    scorer: Callable | None = None       # model -> an evaluation scorer (models.families)
    encoder: Callable | None = None      # (config, init_seed=) -> a finetuning encoder
    decoder: Callable | None = None      # (model, use_cache=) -> a generation decoder
    hf_sequence_classification: bool = False  # a finetuned classifier exports to a transformers *ForSequence...

    def parts(self) -> tuple[str, ...]:
        """The names of the parts this family has."""
        return tuple(what for what in PARTS if getattr(self, what) is not None)

    def get(self, what: str) -> Any:
        """The function or class this family holds as ``what`` (one of ``PARTS``)."""
        part = getattr(self, what, None) if what in PARTS else None
        if part is None:
            raise ConfigError(f"the {self.name} model family has no {what.replace('_', ' ')}; "
                              f"it has {', '.join(self.parts()) or 'none'}")
        return part

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
    hf_exporter=export_gpt, hf_verifier=gpt_logits, scorer=GPTScorer, encoder=GPTEncoder, decoder=GPTDecoder,
    hf_sequence_classification=True))

register(ModelFamily(
    name="mlstm", config_class=MLSTMConfig, default_preset="mlstm-tiny", default_tokenizer="bytes",
    layouts="data parallelism (and ZeRO)", build_module=_build_mlstm, stream_data=True,
    pipeline_parallel_capable=False, tensor_parallel_capable=False,
    hf_exporter=export_mlstm, hf_verifier=mlstm_logits, scorer=MLSTMScorer, encoder=MLSTMEncoder,
    decoder=MLSTMDecoder))


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
