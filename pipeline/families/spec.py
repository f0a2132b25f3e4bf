"""What a model family is to the commands (``ModelFamily``, in the spirit of torchtitan's ModelSpec): its config
class, its builders, the layouts it trains at, its pipeline's parameter names, its Hugging Face exporter and
verifier, its evaluation scorer, generation decoder and finetuning encoder, and its shape for the planner, as real
callables. Each family's
entry is ``FAMILY`` in its folder, ``pipeline/families/<family>/``; ``pipeline.job.families`` registers them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models.config import ConfigError
from models.parallel import Layout, get_parallel_state, get_shard_spec
from pipeline.job.layout import LayoutCheck, validate

# the family parts ``ModelFamily.get`` hands out by name
PARTS = ("hf_exporter", "hf_verifier", "scorer", "encoder", "decoder", "shape")


@dataclass(frozen=True)
class PipelineNames:
    """How the family's pipeline-parallel engine names the full model's parameters (by stage layer index), for the
    checkpoints that move between a pipeline and the full model (``pipeline.checkpoints.universal``)."""
    to_pipeline: Callable[[str, Any], str]    # (the full model's parameter name, config) -> the pipeline's name
    from_pipeline: Callable[[str, Any], str]  # the inverse
    first_stage_copies: tuple[str, ...] = ()  # patterns of the pipeline's names held by several stages (a tied
    #                                           embedding): the first stage's copy is the one a checkpoint keeps


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
    scorer: Callable | None = None       # model -> an evaluation scorer
    encoder: Callable | None = None      # (config, init_seed=) -> a finetuning encoder
    decoder: Callable | None = None      # (model, use_cache=) -> a generation decoder
    shape: Callable | None = None        # (config, name, seq) -> the planner's pipeline.planning.ModelShape
    hf_sequence_classification: bool = False  # a finetuned classifier exports to a transformers *ForSequence...
    pipeline_names: PipelineNames | None = None  # with pipeline_parallel_capable: its pipeline's parameter names

    def __post_init__(self):
        if self.pipeline_parallel_capable and self.pipeline_names is None:
            raise ValueError(f"the {self.name} model family trains with pipeline stages: give it pipeline_names")

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

    def meta_model(self, config, layout: Layout | None = None) -> torch.nn.Module:
        """The full model built on the meta device (no memory): its parameter names and ShardSpecs."""
        with torch.device("meta"):
            return self.build(config, 0, layout)

    def shard_specs(self, config) -> dict:
        """{parameter name: ShardSpec or None} of the full state dict, from a model built on the meta device (with
        every expert: a full state dict names them all, whatever this rank's expert-parallel size)."""
        model = self.meta_model(config, get_parallel_state().layout.replace(expert=1))
        return {name: get_shard_spec(p) for name, p in model.named_parameters()}
