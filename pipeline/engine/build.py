"""The DeepSpeed engine for a model config at any (TP, PP, DP) layout.

PP = 1: the GPT goes to ``deepspeed.initialize(mpu=...)``, so gradients are
reduced over the data-parallel group only (data x context under context parallelism: summed over the
chunks, averaged over data) and the global gradient norm counts each tensor-parallel shard once.
PP > 1: the GPT becomes a ``PipelineModule``
on the same 3-D topology and trains with ``train_batch``.
"""
from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from models import GPT
from models.gpt import select_recompute_modules
from models.moe import register_expert_groups
from models.parallel import ParallelState

from pipeline.checkpoints import safe_load
from pipeline.engine.host_memory import keep_freed_host_memory
from pipeline.engine.pipe_model import carries_several, gpt_pipeline, pipe_to_gpt_name
from pipeline.engine.schedules import LRSchedule, Scheduler
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.checkpoints.universal import attach_info
from pipeline.engine.ds_config import (EngineConfigError, context_parallel_ds_config, whole_stage_activations_ds_config,
                                       zero_stage)


def param_groups(model: torch.nn.Module, weight_decay: float | None = None) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), as Megatron and GPT-2 train."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    return [g for g in groups if g["params"]]


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """Expert parameters in groups of their own (DeepSpeed-MoE: ZeRO-1/2 partition them over the expert-data
    group, and their gradients are averaged there, not over the whole data-parallel group); others unchanged."""
    if not any(is_moe_param(p) for g in groups for p in g["params"]):
        return groups
    named = [{"name": f"group{i}", **g} for i, g in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def zero3_over_data_and_context(model: torch.nn.Module, ds_config: dict, state: ParallelState) -> dict:
    """Partition the model for ZeRO-3 over data x context before DeepSpeed does: DeepSpeed's own conversion
    (``DeepSpeedZeRoOffload._convert_to_zero_parameters``) partitions over ``mpu.get_data_parallel_group()``, and
    stage 3 reduces each gradient over its parameter's partition group, so the chunks' gradients would never be
    summed. Returns the config with the all-reduce reduction path (``context_parallel_ds_config``)."""
    ds_config = context_parallel_ds_config(ds_config, largest_param=max(p.numel() for p in model.parameters()))
    deepspeed.zero.Init(module=model, data_parallel_group=state.get_sequence_data_parallel_group(),
                        config_dict_or_path=ds_config, mpu=state)
    return ds_config


def skip_nonfinite_steps_by_the_norm(engine) -> None:
    """bf16 under ZeRO 1/2: let the gradient norm alone decide which steps to skip, as DeepSpeed's fp32 path does.

    DeepSpeed reads every gradient twice before a bf16 step: a NaN/Inf pass (``check_overflow``: one kernel per
    gradient, two all-reduces, one host sync) and the norm it computes anyway (clipping, the log), which is invalid
    whenever a gradient is NaN or Inf and then skips the step by itself. The first pass finds nothing the second
    does not; it was 1.4% of a llama medium step at one CPU rank (bench/train_step.py). Same steps skipped,
    ``engine.skipped_steps`` counts them. (The norm counts a TP-replicated parameter on tensor rank 0 only, the
    pass on every rank: their gradients are the same on all TP ranks, all-reduced under SP.)"""
    opt = engine.optimizer
    if (isinstance(opt, DeepSpeedZeroOptimizer) and opt.dtype == torch.bfloat16 and opt.check_grad_overflow
            and opt.compute_grad_norm):
        opt.check_overflow = lambda partition_gradients=True: None  # self.overflow stays False until the norm says


def skip_reducing_over_one_rank(engine, state: ParallelState) -> None:
    """Over a data-parallel group of one process DeepSpeed still reduces every gradient: without ZeRO it
    flattens them into buckets, all-reduces them and copies them back; ZeRO 1/2 divide every bucket by 1 (0.4%
    of a medium model's step at one CPU rank; a single-GPU finetune pays it too). Under context parallelism the
    group is data x context and the chunks' gradients must be summed, so only when that group is one process."""
    if state.get_sequence_data_parallel_world_size() != 1:
        return
    if not engine.is_pipe and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False
    elif isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        engine.optimizer.gradient_average = False  # over one rank the sum is the mean


def frozen_tied_weights_not_reduced(engine) -> None:
    """A pipeline's tied weight that does not train (LoRA's frozen embedding, on the first and last stages) has no
    gradient to all-reduce between its stages; DeepSpeed's reduction skips a missing gradient, but under its bf16
    optimizer (ZeRO-0) reads the attribute that optimizer gives only the weights it holds."""
    for weight, _ in engine.module.get_tied_weights_and_groups():
        if not weight.requires_grad and not hasattr(weight, "_hp_grad"):
            weight._hp_grad = None


def build_engine(model_config, ds_config: dict, state: ParallelState, *, init_seed: int,
                 schedule: LRSchedule | None = None, activation_checkpointing: bool = False, model_builder=None,
                 full_state_dict: dict | None = None, param_groups_fn=None, recompute: str | None = None,
                 recompute_modules=None, packed_rows: bool = False, adapt=None):
    """A DeepSpeed engine for the GPT (or any model ``model_builder(config, init_seed=...)`` returns, PP=1 only) at
    the layout of ``state`` (``state.layout``, validated by ``pipeline.job.layout`` before the process groups were
    built), in three steps: ``construct`` the model at this rank's shard, ``parallelize`` it (recomputation, ZeRO-3's
    and the experts' groups), ``optimize`` it (DeepSpeed's engine, optimizer and schedule).

    ``ds_config`` must have been through ``resolve_ds_config``. ``full_state_dict`` (full TP=1 weights,
    e.g. of a checkpoint saved at another layout) is loaded into this rank's shards before DeepSpeed
    takes the model, so its fp32 master weights start from it. ``param_groups_fn(model)`` gives the
    optimizer's parameter groups (default ``param_groups``); a group's ``lr_mult`` scales the scheduled
    learning rate (e.g. layer-wise decay when finetuning). Returns the engine; ``engine.is_pipe``
    tells which training step to use. ``recompute``: none, selective (each layer's ``recompute_modules``:
    core_attn, Megatron-Core's default, mlp_act, layernorm; ``models.gpt.select_recompute_modules``) or full
    (every layer; ``activation_checkpointing`` is its old name); by default the layout's. ``packed_rows``: the
    pipeline's stages take (input ids, document ids), packed rows attending document by document
    (``pipe_model.PackedRowsTransformerLayer``). ``adapt(model)``: called on the model (a stage's, on pipeline
    stages) once its weights are loaded, before DeepSpeed takes it (LoRA's adapters).
    """
    layout = state.layout
    recompute = "full" if activation_checkpointing else recompute or layout.recompute
    recompute = Recompute(recompute, recompute_modules or layout.recompute_modules or ("core_attn",))
    if get_accelerator().device_name() == "cpu":
        keep_freed_host_memory()  # DeepSpeed's per-step gradient buffers would be faulted in again every step
    if layout.sequence_parallel or carries_several(model_config):
        ds_config = whole_stage_activations_ds_config(ds_config, state)
    checkpoint_fn = recompute.checkpoint_fn(state, ds_config)
    model = construct(model_config, state, init_seed, model_builder=model_builder, full_state_dict=full_state_dict,
                      checkpoint_fn=checkpoint_fn if recompute.policy == "full" else None, packed_rows=packed_rows)
    if adapt is not None:
        adapt(model)
    ds_config = parallelize(model, model_config, ds_config, state, recompute, checkpoint_fn, adapt)
    return optimize(model, model_config, ds_config, state, schedule, param_groups_fn)


@dataclass(frozen=True)
class Recompute:
    policy: str                      # none, selective or full
    modules: tuple[str, ...]         # what selective recomputes

    def __post_init__(self):
        if self.policy not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, not {self.policy!r}")

    def checkpoint_fn(self, state: ParallelState, ds_config: dict):
        """DeepSpeed's checkpoint (it restores the model-parallel RNG tracker: the same dropout masks), or None."""
        if self.policy == "none":
            return None
        deepspeed.checkpointing.configure(state, deepspeed_config=ds_config)
        return deepspeed.checkpointing.checkpoint


def construct(model_config, state: ParallelState, init_seed: int, *, model_builder=None,
              full_state_dict: dict | None = None, checkpoint_fn=None, packed_rows: bool = False) -> torch.nn.Module:
    """The model at this rank's shard of the layout: the GPT, a ``PipelineModule`` of its stages (PP > 1; of packed
    rows with ``packed_rows``), or what ``model_builder`` returns; ``full_state_dict`` loaded into the shards;
    ``checkpoint_fn`` around every layer (full recomputation)."""
    if state.pipeline_parallel > 1:
        if model_builder is not None:
            raise EngineConfigError("pipeline parallelism is only available for the GPT models")
        model = gpt_pipeline(model_config, state, init_seed, activation_checkpointing=checkpoint_fn is not None,
                             checkpoint_fn=checkpoint_fn, packed_rows=packed_rows)
        if full_state_dict is not None:
            load_full_state_dict(model, full_state_dict, partial=True, source="checkpoint weights",
                                 name_map=lambda n: pipe_to_gpt_name(n, model_config))
        return model
    model = (model_builder or GPT)(model_config, init_seed=init_seed)
    if full_state_dict is not None:
        load_full_state_dict(model, full_state_dict, source="checkpoint weights")
    if checkpoint_fn is not None:
        model.checkpoint_fn = checkpoint_fn
    return model


def parallelize(model: torch.nn.Module, model_config, ds_config: dict, state: ParallelState, recompute: Recompute,
                checkpoint_fn, adapt=None) -> dict:
    """What the layout asks of the model beyond its shards: selective recomputation, ZeRO-3's view of the tied
    output layer and its partition over data x context, the pipeline's batch under context parallelism, FP8
    products, the checkpoint's record. Returns the DeepSpeed config the engine takes."""
    if state.pipeline_parallel > 1 and state.context_parallel > 1:
        # the pipeline grid counts every CP rank as a data-parallel one (pipe_topology)
        ds_config = {**ds_config, "train_batch_size": ds_config["train_batch_size"] * state.context_parallel}
    if (state.pipeline_parallel == 1 and zero_stage(ds_config) == 3 and
            getattr(model, "lm_head", 1) is None):
        # the tied output layer reads the embedding weight outside the embedding's forward
        deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)
    if recompute.policy == "selective":
        select_recompute_modules(model, checkpoint_fn, recompute.modules)
    if state.layout.fp8:  # the parallel linears' products only: the weights DeepSpeed takes stay as they are
        from models.parallel.fp8 import enable_fp8, fp8_matmuls_on  # noqa: PLC0415 (torchao: ~2 s of imports)
        device = torch.device(get_accelerator().current_device_name())  # where DeepSpeed will put the model
        enable_fp8(model, state.layout.fp8, emulate=not fp8_matmuls_on(device))
    attach_info(model, model_config, pipeline=state.pipeline_parallel > 1, adapt=adapt)  # saved with every checkpoint
    return ds_config


def optimize(model: torch.nn.Module, model_config, ds_config: dict, state: ParallelState,
             schedule: LRSchedule | None = None, param_groups_fn=None):
    """DeepSpeed's engine over ``model``: its optimizer over ``param_groups_fn(model)`` (the experts' in groups of
    their own, over the layout's expert groups), the learning-rate ``schedule``, safe loading, and the passes
    DeepSpeed makes for nothing dropped (``skip_nonfinite_steps_by_the_norm``, ``skip_reducing_over_one_rank``)."""
    if schedule is not None and "scheduler" in ds_config:
        raise EngineConfigError("the DeepSpeed config has a \"scheduler\" section and a learning-rate schedule was "
                                "given too; remove one of them")
    lr_scheduler = (lambda opt: Scheduler(opt, schedule)) if schedule is not None else None
    groups = moe_param_groups((param_groups_fn or param_groups)(model))  # before ZeRO-3 flattens the parameters
    if zero_stage(ds_config) == 3 and state.context_parallel > 1:
        ds_config = zero3_over_data_and_context(model, ds_config, state)
    if any(is_moe_param(p) for g in groups for p in g["params"]):
        register_expert_groups(state)
    pipe = state.pipeline_parallel > 1  # the PipelineEngine builds its grid from the module's topology: no mpu
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config,
                                           mpu=None if pipe else state, lr_scheduler=lr_scheduler)
    safe_load.install(engine)  # loads weights only, hashes what it saves
    engine.is_pipe = pipe
    if engine.is_pipe:  # a non-finite gradient is named as the GPT's parameter (grad_watch)
        engine.param_display_name = lambda n: pipe_to_gpt_name(n, model_config)
        frozen_tied_weights_not_reduced(engine)
    skip_nonfinite_steps_by_the_norm(engine)
    skip_reducing_over_one_rank(engine, state)
    return engine
