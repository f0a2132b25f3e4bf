"""One layout, validated once: every combination rule of the project in one list, run before any process group,
output or data is touched.

    layout = layout_from_options(options, ds)             # the command line (and the DeepSpeed config)
    validate(LayoutCheck(layout, config, family, ds, source))  # the first rule that refuses raises LayoutError

Each rule is a function of one ``LayoutCheck`` returning ``None`` (allowed) or the refusal: one line that names
the features that meet and what to do. A parallel dimension or a memory feature is one field of ``Layout`` and
its rules here; ``docs/composition.md`` is generated from these rules and the composition tests
(``python -m pipeline.job.composition``), and a test fails when they disagree.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from models.gpt import RECOMPUTE_MODULES
from models.parallel import Layout
from models.parallel.layout import FP8_RECIPES, PRECISIONS, RECOMPUTE_POLICIES

from pipeline.engine.distributed import launched_world_size
from pipeline.engine.ds_config import enabled, precision, zero_stage
from pipeline.engine.pipe_model import stage_layers
from pipeline.job.errors import UserError

class LayoutError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class LayoutCheck:
    """What the rules read: the layout, the model config (None: not known yet, its rules wait), its family (a
    ``job.families.ModelFamily``: what it trains at; None: a GPT), the DeepSpeed config and where it came from,
    and the run's other options that meet the layout (``extras``: ``sample_interval``, ``world``)."""
    layout: Layout
    config: object = None
    family: object = None
    ds: dict = field(default_factory=dict)
    source: str = "DeepSpeed config"
    extras: dict = field(default_factory=dict)

    @property
    def experts(self) -> int:
        return getattr(self.config, "num_experts", 0) or 0

    @property
    def gpt(self) -> bool:
        """Whether the model is a transformer that every parallel dimension and memory feature splits."""
        return self.family is None or (self.family.tensor_parallel_capable and self.family.pipeline_parallel_capable)


Rule = Callable[[LayoutCheck], "str | None"]
MOE_RUN_RESUMED_FROM = "moe_run_resumed_from"  # extras: the saved Layout of a run with MoE layers resumed elsewhere
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def validate(check: LayoutCheck) -> None:
    """Raise ``LayoutError`` with the first refusal of ``RULES``."""
    reason = refusal(check)
    if reason:
        raise LayoutError(reason)


def refusal(check: LayoutCheck) -> str | None:
    """The first refusal of ``RULES`` for ``check``, or None when the layout is allowed."""
    return next((reason for reason in map(lambda r: r(check), RULES) if reason), None)


def layout_from_options(options, ds: dict, world: int | None = None) -> Layout:
    """The run's ``Layout`` from ``job.options.EngineOptions`` and the DeepSpeed config (ZeRO stage, precision);
    ``world``: the launcher's WORLD_SIZE by default (the data-parallel size is what the other sizes leave)."""
    world = world if world is not None else launched_world_size()
    modules = tuple(getattr(options, "recompute_modules", None) or ())
    recompute = getattr(options, "recompute", "none") or "none"
    return Layout.for_world(
        world, tensor=options.tensor_parallel, pipeline=options.pipeline_parallel, context=options.context_parallel,
        expert=options.expert_parallel, sequence_parallel=options.sequence_parallel, zero_stage=zero_stage(ds),
        precision=precision(ds), tiled_mlp=options.tiled_mlp, tiled_loss=options.tiled_loss, recompute=recompute,
        recompute_modules=modules if recompute == "selective" else (), compile=getattr(options, "compile", False),
        fp8=getattr(options, "fp8", None), loss_chunk_tokens=getattr(options, "loss_chunk_tokens", None) or 0)


def world_of(check: LayoutCheck) -> int:
    return int(check.extras.get("world", check.layout.world))


# -- sizes and the world ---------------------------------------------------------------------------------------------

@rule
def sizes_are_positive(c: LayoutCheck) -> str | None:
    L = c.layout
    for flag, value in (("--tensor-parallel", L.tensor), ("--pipeline-parallel", L.pipeline),
                        ("--context-parallel", L.context), ("--expert-parallel", L.expert),
                        ("--tiled-mlp", L.tiled_mlp), ("--tiled-loss", L.tiled_loss)):
        if not isinstance(value, int) or value < 1:
            return f"{flag} {value}: must be a whole number, 1 or more; give 1 to switch it off"
    if not isinstance(L.loss_chunk_tokens, int) or L.loss_chunk_tokens < 0:
        return f"--loss-chunk-tokens {L.loss_chunk_tokens}: must be a whole number, 1 or more; leave it out for none"
    if L.precision not in PRECISIONS or L.recompute not in RECOMPUTE_POLICIES:
        return f"layout: precision {L.precision!r} / recompute {L.recompute!r} unknown"
    if L.fp8 is not None and L.fp8 not in FP8_RECIPES:
        return f"--fp8 {L.fp8}: unknown recipe; choose from {', '.join(FP8_RECIPES)}"
    return None


@rule
def world_divides(c: LayoutCheck) -> str | None:
    L, world = c.layout, world_of(c)
    if world % L.model_ranks:
        cp = f" x --context-parallel {L.context}" if L.context > 1 else ""
        return (f"world size {world}: not divisible by --tensor-parallel {L.tensor}{cp} x --pipeline-parallel "
                f"{L.pipeline} = {L.model_ranks}; launch a multiple of {L.model_ranks} processes or change the "
                f"parallel sizes")
    return None


# -- the model family ------------------------------------------------------------------------------------------------

@rule
def family_takes_the_layout(c: LayoutCheck) -> str | None:
    if c.gpt:
        return None
    L = c.layout
    for flag, value, off in (("--tensor-parallel", L.tensor, 1), ("--pipeline-parallel", L.pipeline, 1),
                             ("--context-parallel", L.context, 1), ("--tiled-mlp", L.tiled_mlp, 1),
                             ("--tiled-loss", L.tiled_loss, 1), ("--sequence-parallel", L.sequence_parallel, False),
                             ("--fp8", L.fp8, None), ("--loss-chunk-tokens", L.loss_chunk_tokens, 0)):
        if value != off:
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            return (f"{shown} with the {c.family.name} model: it trains with {c.family.layouts} only; "
                    f"drop {flag}")
    if L.recompute == "selective":
        return (f"--recompute selective with the {c.family.name} model: its modules are the transformer's; "
                f"use --recompute full or none")
    return None


@rule
def sequence_parallel_needs_tensor_parallel(c: LayoutCheck) -> str | None:
    if c.layout.sequence_parallel and c.layout.tensor == 1:
        return ("--sequence-parallel splits the sequence across the tensor-parallel ranks and does nothing with "
                "--tensor-parallel 1; drop it or use --tensor-parallel 2 or more")
    return None


@rule
def model_splits(c: LayoutCheck) -> str | None:
    """Heads, MLP columns and the sequence divide by the sizes that split them (the model config's checks)."""
    if c.config is None or not c.gpt:
        return None
    L = c.layout
    try:
        c.config.check_parallel(L.tensor, L.pipeline, L.context, sequence_parallel=L.sequence_parallel)
    except ValueError as e:
        return str(e)
    return None


# -- mixture of experts ----------------------------------------------------------------------------------------------

@rule
def experts_split(c: LayoutCheck) -> str | None:
    L = c.layout
    if L.expert > 1 and not c.experts and c.config is not None:
        return (f"--expert-parallel {L.expert} with a dense model (num_experts 0): nothing to split; drop "
                f"--expert-parallel or set num_experts in the model config")
    if c.experts and c.experts % L.expert:
        return f"--expert-parallel {L.expert}: does not divide num_experts {c.experts}; choose a divisor of it"
    if L.expert > 1 and (L.data * L.context) % L.expert:
        return (f"--expert-parallel {L.expert}: does not divide data x context parallel {L.data * L.context}; "
                f"choose a divisor of it (world = TP x PP x CP x DP)")
    return None


@rule
def experts_and_zero3(c: LayoutCheck) -> str | None:
    if c.experts and c.layout.zero_stage == 3:
        return (f"{c.source}: zero_optimization.stage 3 with MoE layers: DeepSpeed 0.19 partitions no expert "
                f"parameters under ZeRO-3; use stage 1 or 2")
    return None


def experts_cannot_move(layout: Layout) -> str | None:
    """Why the optimizer state of a run with MoE layers cannot leave or reach ``layout``:
    ``checkpoints.universal.convert_moe`` reads the ZeRO-1/2 files (fp32, bf16 or fp16: the same fp32 partitions) of
    a run without stages, and ``universal.load`` gives the experts' global names to ZeRO-1/2's loader only."""
    if layout.pipeline > 1:
        return "an MoE run moves to another layout without pipeline parallelism only"
    if layout.zero_stage not in (1, 2):
        return "an MoE run's optimizer state moves between ZeRO-1/2 layouts only"
    return None


@rule
def experts_move_between_layouts(c: LayoutCheck) -> str | None:
    """A run with MoE layers resumed at another layout (``extras[MOE_RUN_RESUMED_FROM]``: the layout it was saved
    at): refused, not resumed with the optimizer state restarted, a path untested for experts."""
    saved = c.extras.get(MOE_RUN_RESUMED_FROM)
    reason = saved is not None and (experts_cannot_move(saved) or experts_cannot_move(c.layout))
    return f"{c.source}: {reason}; resume it at the layout it was saved at ({saved})" if reason else None


@rule
def deepseek_options_where_built(c: LayoutCheck) -> str | None:
    """A dense model's multi-token prediction on pipeline stages runs where it was built (otherwise latent
    attention and multi-token prediction train as one process at TP with or without SP, CP, PP, EP, ZeRO 1-2 and the
    tiled loss, and the grouped experts with the tiled MLP: tests/pipeline/job/test_deepseek_layouts.py,
    tests/pipeline/job/test_composition.py)."""
    L, cfg = c.layout, c.config
    if (getattr(cfg, "mtp_num_layers", 0) and not getattr(cfg, "num_experts", 0) and L.pipeline > 1
            and L.recompute == "full"):
        return ("mtp_num_layers with --pipeline-parallel and --recompute full on a model without experts: its stages' "
                "layers carry the input ids to the multi-token prediction on the last stage and are not among "
                "DeepSpeed's checkpointed layers; use --recompute selective or set mtp_num_layers 0")
    return None


# -- tiling ----------------------------------------------------------------------------------------------------------

@rule
def tiled_mlp_and_sequence_parallel(c: LayoutCheck) -> str | None:
    if c.layout.tiled_mlp > 1 and c.layout.sequence_parallel:
        return ("--tiled-mlp with --sequence-parallel: DeepSpeed's TiledMLP recomputes its tiles as rows of [batch x "
                "sequence], which a sequence-parallel MLP (gathered along the sequence) cannot take; drop one of "
                "them (--tiled-loss composes with both)")
    return None


@rule
def tiles_fit_the_sequence(c: LayoutCheck) -> str | None:
    seq = getattr(c.config, "seq_length", None)
    if seq is None:
        return None
    local = seq // c.layout.context
    for flag, tiles in (("--tiled-mlp", c.layout.tiled_mlp), ("--tiled-loss", c.layout.tiled_loss)):
        if tiles > local:
            return (f"{flag} {tiles}: more tiles than the {local} tokens of each rank's sequence (seq_length {seq}"
                    f"{f' / context parallel {c.layout.context}' if c.layout.context > 1 else ''}); give at most "
                    f"{local}")
    return None


@rule
def tiled_loss_and_a_tied_embedding_under_zero(c: LayoutCheck) -> str | None:
    if c.layout.tiled_loss > 1 and c.layout.zero_stage >= 2 and getattr(c.config, "tie_embeddings", False):
        # DeepSpeed's sequence_tiled_compute marks the weight's gradient ready after its last tile; the input
        # embedding's share of the same tied weight arrives after that, a second reduction ZeRO 2/3 refuse (measured)
        return (f"--tiled-loss with ZeRO stage {c.layout.zero_stage} and tied embeddings: the tied word embedding's "
                f"gradient arrives twice (the tiled output layer's, then the input embedding's) and DeepSpeed's "
                f"stage {c.layout.zero_stage} reduces a gradient once; use ZeRO stage 1, untie the embeddings, or drop "
                f"--tiled-loss")
    return None


@rule
def tiled_loss_and_pipeline_stages(c: LayoutCheck) -> str | None:
    if c.layout.tiled_loss > 1 and c.layout.pipeline > 1:
        # the composition matrix found it ignored: the last stage's output layer runs before the loss function
        return ("--tiled-loss with --pipeline-parallel: the last pipeline stage computes the whole output layer "
                "before DeepSpeed's pipeline loss function, so nothing would be tiled; drop --tiled-loss or use "
                "--pipeline-parallel 1")
    return None


# -- recomputation and compile ---------------------------------------------------------------------------------------

@rule
def recompute_modules_exist(c: LayoutCheck) -> str | None:
    L = c.layout
    if L.recompute != "selective" or c.config is None or not c.gpt:
        return None
    modules = set(L.recompute_modules)
    unknown = modules - set(RECOMPUTE_MODULES)
    if unknown:
        return f"--recompute-modules {','.join(sorted(unknown))}: unknown; choose from {', '.join(RECOMPUTE_MODULES)}"
    if {"mlp", "mlp_act"} <= modules:
        return "--recompute-modules mlp with mlp_act: mlp recomputes the whole MLP, mlp_act included; name one"
    layers = range(c.config.num_layers)
    dense = any(not c.config.is_moe_layer(i) for i in layers)
    if "moe_act" in modules and not c.experts:
        return ("--recompute-modules moe_act with a dense model: it has no experts; drop moe_act (mlp_act is the "
                "dense MLP's)")
    if modules & {"mlp", "mlp_act"} and not dense:
        return ("--recompute-modules mlp / mlp_act with a model whose every layer is MoE: there is no dense MLP; use "
                "moe_act")
    return None


@rule
def compile_where_built(c: LayoutCheck) -> str | None:
    """``--compile`` compiles each transformer block (models/compile.py), tested at TP 1-2 with and without SP,
    CP 2, PP 2, EP 2 and with a tiled MLP (the routed experts, the MLP's tiles: eager between the block's two graphs;
    the tiled loss is outside the blocks), ZeRO 0-2, full and selective recomputation, dropout, FP8; ZeRO-3 is
    refused."""
    L = c.layout
    if not L.compile:
        return None
    if L.zero_stage == 3:
        return ("--compile with ZeRO stage 3: its hooks, which gather each module's parameters, would run inside the "
                "compiled blocks; the compiled blocks are built and tested at ZeRO 0-2; drop --compile or use ZeRO "
                "stage 1 or 2")
    return None


@rule
def fp8_where_built(c: LayoutCheck) -> str | None:
    """``--fp8`` casts the column- and row-parallel linears' operands (models/parallel/fp8.py); the composition
    matrix trains it at every layout it allows."""
    if c.layout.fp8 and c.experts:
        return ("--fp8 with MoE layers: the experts' products run in DeepSpeed-MoE's containers, not in the "
                "parallel linears, and are not FP8 yet; drop --fp8 or train a dense model")
    if c.layout.fp8 and c.layout.tiled_mlp > 1:
        # measured by the composition matrix: 1e-4 from one FP8 process, each tile scaled by its own amax
        return ("--fp8 with --tiled-mlp: each tile of the sequence would be cast with its own scale, not the "
                "sequence's; drop --tiled-mlp or --fp8")
    return None


# -- the DeepSpeed config --------------------------------------------------------------------------------------------

@rule
def one_half_precision(c: LayoutCheck) -> str | None:
    if enabled(c.ds, "fp16") and enabled(c.ds, "bf16"):
        return (f"{c.source}: fp16 and bf16 are both enabled; enable one of them (set the other's \"enabled\" to "
                f"false)")
    return None


@rule
def fp16_needs_a_zero_optimizer(c: LayoutCheck) -> str | None:
    L = c.layout
    if L.precision == "fp16" and L.zero_stage == 0 and L.pipeline == 1:
        # Measured with DeepSpeed 0.19.8: engine.backward scales the loss only for ZeRO optimizers,
        # so its ZeRO-0 fp16 optimizer unscales gradients that were never scaled (updates / 2^16).
        return (f"{c.source}: fp16 with ZeRO stage 0: DeepSpeed's ZeRO-0 fp16 optimizer does not apply the loss "
                f"scale in engine.backward; set zero_optimization.stage to 1, or use bf16")
    return None


@rule
def pipeline_and_zero(c: LayoutCheck) -> str | None:
    L = c.layout
    if L.pipeline > 1 and L.zero_stage > 1:
        return (f"{c.source}: ZeRO stage {L.zero_stage} with --pipeline-parallel {L.pipeline}: DeepSpeed's pipeline "
                f"engine shards no gradients or weights; use ZeRO stage 0 or 1 with pipelines, or "
                f"--pipeline-parallel 1")
    if (L.pipeline > 1 and L.zero_stage == 0 and L.precision == "fp32"
            and float(c.ds.get("gradient_clipping", 0.0)) > 0):
        # DeepSpeed's plain fp32 pipeline path clips with a norm that counts tied weights on every stage that
        # holds them; its ZeRO-1 and mixed-precision optimizers count them once.
        return (f"{c.source}: gradient clipping with --pipeline-parallel in fp32 at ZeRO stage 0: DeepSpeed counts "
                f"tied weights once per stage; set zero_optimization.stage to 1, use bf16/fp16, or gradient_clipping 0")
    if L.pipeline > 1 and c.ds.get("zero_optimization", {}).get("offload_optimizer"):
        return (f"{c.source}: zero_optimization.offload_optimizer with --pipeline-parallel: DeepSpeed's pipeline "
                f"engine does not offload; drop offload_optimizer or use --pipeline-parallel 1")
    return None


@rule
def sequence_parallel_activations_whole(c: LayoutCheck) -> str | None:
    if not c.layout.sequence_parallel:
        return None
    if c.ds.get("activation_checkpointing", {}).get("partition_activations"):
        return (f"{c.source}: activation_checkpointing.partition_activations with --sequence-parallel: "
                f"partition_activations splits activations that sequence parallelism has already split across the "
                f"TP ranks; set it to false")
    return _stage_activations_split(c, "--sequence-parallel: each TP rank sends its own sequence chunk between "
                                          "stages")


@rule
def several_stage_activations_whole(c: LayoutCheck) -> str | None:
    cfg = c.config
    if getattr(cfg, "num_experts", 0) or getattr(cfg, "mtp_num_layers", 0):
        return _stage_activations_split(c, "MoE layers or multi-token prediction: the stages carry several tensors "
                                           "(the auxiliary loss, the input ids), and DeepSpeed splits only the first")
    return None


def _stage_activations_split(c: LayoutCheck, why: str) -> str | None:
    """One line when the config asks DeepSpeed's pipeline to split what must go between stages whole."""
    if c.layout.pipeline > 1 and c.layout.tensor > 1:
        for key in ("pipe_partitioned", "grad_partitioned"):
            if c.ds.get("pipeline", {}).get(key):
                return f"{c.source}: pipeline.{key} with {why}; set it to false (or leave it out)"
    return None


@rule
def context_parallel_zero3_reduction(c: LayoutCheck) -> str | None:
    if c.layout.context == 1 or c.layout.zero_stage != 3:
        return None
    zero = c.ds.get("zero_optimization", {})
    for key, needed in (("reduce_scatter", False), ("contiguous_gradients", True)):
        if zero.get(key, needed) != needed:
            return (f"{c.source}: zero_optimization.{key} {str(not needed).lower()} with --context-parallel at ZeRO "
                    f"stage 3: DeepSpeed would give 1/C of the summed gradients of the sequence chunks "
                    f"(docs/long_context.md); set it to {str(needed).lower()} (or leave it out)")
    return None


# -- what else the run does ------------------------------------------------------------------------------------------

POST_TRAINING = "post_training"  # the extras key of the SFT and DPO commands: what they train ("SFT", "DPO")


@rule
def experts_on_every_stage(c: LayoutCheck) -> str | None:
    """DeepSpeed's ZeRO-1/2 reduces the experts' gradient norm over the model-parallel ranks (pipe x tensor) that
    hold experts: a stage without an MoE layer never joins, and the run hangs at its first step."""
    cfg, L = c.config, c.layout
    if L.pipeline == 1 or not getattr(cfg, "num_experts", 0):
        return None
    stages = stage_layers(cfg, L.pipeline)
    last_has_mtp = bool(getattr(cfg, "mtp_num_layers", 0))  # (its depths have experts too)
    empty = [s for s, layers in enumerate(stages)
             if not any(cfg.is_moe_layer(i) for i in layers) and not (last_has_mtp and s == L.pipeline - 1)]
    if not empty:
        return None
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    return (f"--pipeline-parallel {L.pipeline} with MoE layers {moe} of {cfg.num_layers}: stage(s) {empty} (layers "
            f"{[list(stages[s]) for s in empty]}) would hold none, and DeepSpeed's ZeRO reduces the experts' gradient "
            f"norm over the stages that have them (the run would hang); choose moe_layer_freq / first_k_dense_replace "
            f"or --pipeline-parallel so that every stage holds one")


@rule
def post_training_layout(c: LayoutCheck) -> str | None:
    """SFT's packed rows and DPO's pairs go through the model's own forward at every layout (finetune/lm/job,
    models/documents.py); on pipeline stages SFT's rows carry their document ids from stage to stage
    (``pipeline.engine.pipe_model.PackedRowsTransformerLayer``), a stage holding the LoRA adapters of its own
    layers (``models.lora.add_lora``'s ``module_name``); under the tiled loss DPO's completions are summed
    row by row (``models.tiling.tiled_row_cross_entropy``)."""
    what = c.extras.get(POST_TRAINING)
    if what is None:
        return None
    L = c.layout
    if L.pipeline > 1 and what != "SFT":
        return (f"{what} with --pipeline-parallel: its step runs the policy and its reference on the same pairs, "
                f"and the reference (a frozen copy of the base, or the policy with its adapters off) is not built "
                f"as pipeline stages; drop --pipeline-parallel (SFT takes it)")
    if getattr(c.config, "mtp_num_layers", 0):
        return (f"{what} of a model with multi-token prediction (mtp_num_layers {c.config.mtp_num_layers}): its rows "
                f"are attended document by document, and the MTP depths would read each row across its documents; "
                f"finetune a base without MTP modules (mtp_num_layers 0)")
    return None


@rule
def samples_during_training(c: LayoutCheck) -> str | None:
    if c.extras.get("sample_interval") is None:
        return None
    L = c.layout
    for refused, what in ((L.pipeline > 1, "--pipeline-parallel"), (L.context > 1, "--context-parallel"),
                          (L.sequence_parallel, "--sequence-parallel"), (L.tiled_mlp > 1, "--tiled-mlp"),
                          (L.zero_stage == 3, "ZeRO stage 3 (partitioned weights)")):
        if refused:
            return (f"--sample-interval with {what}: the decoder reads whole, replicated weights and sequences; "
                    f"drop --sample-interval or change the layout")
    return None
